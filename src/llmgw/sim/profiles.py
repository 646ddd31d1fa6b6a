"""Simulated node profiles: the boxes the real samples in tests/fixtures/real show. Pure data.

- dgx-h100: 8× H100 SXM, every pair NV18 through NVSwitch (`nvidia-smi topo -m` on an H100
  box: stas00-h100-8gpu-ht-tabs-expanded.txt), 8 ConnectX-7 NDR 400 Gb/s compute adapters.
- hgx-a100: 8× A100-SXM4-80GB, every pair NV12 (stas00-a100-8gpu-nv12-respaced.txt), 8 HDR
  200 Gb/s adapters (ibstat-hdr-cx6-mt4123-rate200.txt: `Rate: 200`).
- pcie-4gpu-bridged: 4 PCIe cards joined in pairs by NVLink bridges, NV4 within a pair and
  nothing across (rtx-a6000-x3-nvlink-bridge-pair-plus-unbridged.txt), one HDR adapter.
- roce-8nic: 8× H20 at NV18 with 8 RoCE NICs (sglang-issue24966-8xh20-nv18-8nic.txt), each
  port with the GID table a ConnectX builds for one IPv4 address: 0 v1 link-local, 1 v2
  link-local, 2 v1 IPv4, 3 v2 IPv4 (ibv_devinfo -v on anl-chrysalis: `GID[  3]: ::ffff:…, RoCE v2`).
"""

from __future__ import annotations

PROFILES: dict[str, dict[str, object]] = {
    "dgx-h100": {
        "gpus": 8, "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_memory_mib": 81559, "nvlink": "nv18",
        "ib_ports": 8, "ib_rate": "400 Gb/sec (4X NDR)", "roce_ports": 0,
    },
    "hgx-a100": {
        "gpus": 8, "gpu_name": "NVIDIA A100-SXM4-80GB", "gpu_memory_mib": 81920, "nvlink": "nv12",
        "ib_ports": 8, "ib_rate": "200 Gb/sec (4X HDR)", "roce_ports": 0,
    },
    "pcie-4gpu-bridged": {
        "gpus": 4, "gpu_name": "NVIDIA RTX A6000", "gpu_memory_mib": 49140, "nvlink": "pairs-nv4",
        "ib_ports": 1, "ib_rate": "200 Gb/sec (4X HDR)", "roce_ports": 0,
    },
    "roce-8nic": {
        "gpus": 8, "gpu_name": "NVIDIA H20", "gpu_memory_mib": 97871, "nvlink": "nv18",
        "ib_ports": 0, "roce_ports": 8, "roce_rate": "400 Gb/sec (4X NDR)",
    },
}

# What a node without a profile gets (the flags' defaults before profiles existed).
BASE: dict[str, object] = {
    "gpus": 8, "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_memory_mib": 81559, "nvlink": "nv18",
    "ib_ports": 4, "ib_rate": "400 Gb/sec (4X NDR)", "roce_ports": 0, "roce_rate": "200 Gb/sec (4X HDR)",
}
