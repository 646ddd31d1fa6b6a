"""The fake pynvml the tests use (tests/unit/test_discovery.py) against the real nvidia-ml-py
module (issue 44), so that the fake cannot drift from what the agent meets on a GPU node.

Nothing here needs a GPU: `import pynvml` works without a driver (only nvmlInit fails), and the
real wrappers run against a stub in place of libnvidia-ml's function pointers, which returns
NVML_SUCCESS and leaves every output zeroed, so their real return types are seen here too.
Checked, for every name the code in src/ reads from NVML and every name the fake provides:
- it exists in the real module (a function, a constant or an error class of the same kind);
- each call the code makes binds to the real signature and to the fake's, and the fake accepts
  no number of arguments the real one refuses;
- the fake's constants have the real values (NVML_NVLINK_MAX_LINKS, the most links a GPU can
  have, only as many or fewer: the fake's boards have 18, nvidia-ml-py 13 says 36);
- the fake's error classes are NVMLError subclasses there too;
- what the fake returns has the real return value's attributes, with the same kinds (str, int):
  the code's `str(pci.busId)` is only right while the real busId is a str, not bytes.
The same checks run on the device machine (tools/device-check.sh), against a real NVML.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.test_discovery import HGX_BUSES, SWITCH_BUSES, doctor_nvml, fake_nvml

pynvml = pytest.importorskip("pynvml")  # a dependency of llmgw: there wherever llmgw installs

SRC = Path(__file__).resolve().parents[2] / "src" / "llmgw"


def _is_nvml_name(name: str) -> bool:
    """NVML's functions, constants and errors, and the ctypes structs the code fills in
    (c_nvmlGpuFabricInfo_t: passed by reference to calls that hand them straight to C)."""
    return name.startswith(("nvml", "NVML", "c_nvml"))


def _is_struct_name(name: str) -> bool:
    return name.startswith("c_nvml")


def _struct_fields(cls: type) -> set[str]:
    return {field[0] for klass in cls.__mro__ for field in getattr(klass, "_fields_", [])}


@functools.cache
def code_uses() -> dict[str, set[int]]:
    """Every NVML name the sources read (`nv.X`, `pynvml.X`, `getattr(nv, "X", ...)`), with the
    numbers of positional arguments each is called with (empty: never called)."""
    uses: dict[str, set[int]] = defaultdict(set)
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_nvml_name(node.attr):
                uses[node.attr]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and _is_nvml_name(node.args[1].value)):
                uses[node.args[1].value]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_nvml_name(node.func.attr):
                assert not node.keywords, f"{path.name}:{node.lineno}: {node.func.attr} called with keywords"
                uses[node.func.attr].add(len(node.args))
    return dict(uses)


def fakes() -> list[SimpleNamespace]:
    """The fake in each of the shapes the tests build it in."""
    links = {0: [("gpu", 0x2A)] * 2 + [("switch", SWITCH_BUSES[0])], 1: [("gpu", 0x18)] * 2}
    return [
        fake_nvml(HGX_BUSES[:2], links),
        fake_nvml(HGX_BUSES[:2], links, remote_pci=False, remote_type=False),
        doctor_nvml([SimpleNamespace(device=0, eventData=79)]),
    ]


def fake_items() -> list[tuple[str, Any]]:
    """(name, what the fake provides under it) in every shape, a name once per distinct value
    (NVML names only: the fake's own bookkeeping, like doctor_nvml's `registered`, is no part
    of the API)."""
    items: list[tuple[str, Any]] = []
    for nv in fakes():
        for name, value in vars(nv).items():
            if _is_nvml_name(name) and not any(n == name and v is value for n, v in items):
                items.append((name, value))
    return items


def fake_names() -> dict[str, Any]:
    """Name → what the fake provides under it (the last shape's, doctor_nvml's, where several)."""
    return dict(fake_items())


def _is_function(value: Any) -> bool:
    return callable(value) and not isinstance(value, type)


def _accepts(fn: Any, count: int) -> bool:
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    return True


# ---- names ------------------------------------------------------------------------------------


def test_the_code_reads_some_nvml_at_all():
    """The scan finds what discovery and the Xid watcher call (a scan that found nothing would
    make every check below pass)."""
    uses = code_uses()
    for name in ("nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetNvLinkRemotePciInfo", "nvmlEventSetWait",
                 "nvmlDeviceGetTotalEccErrors", "NVML_NVLINK_MAX_LINKS", "NVMLError_GpuIsLost"):
        assert name in uses, name
    assert uses["nvmlDeviceGetNvLinkState"] == {2}


def test_every_name_the_code_reads_is_in_the_real_module():
    missing = sorted(name for name in code_uses() if not hasattr(pynvml, name))
    assert missing == [], f"the code reads NVML names nvidia-ml-py {_version()} does not have: {missing}"


def test_every_name_the_code_reads_is_faked():
    """What the fake leaves out, the tests never drive: a call the code makes only on a GPU."""
    missing = sorted(set(code_uses()) - set(fake_names()))
    assert missing == [], f"the fake pynvml lacks names the code reads: {missing}"


def test_every_name_the_fake_provides_is_in_the_real_module():
    missing = sorted(name for name in fake_names() if not hasattr(pynvml, name))
    assert missing == [], f"the fake pynvml provides names nvidia-ml-py {_version()} does not have: {missing}"


def test_each_name_is_the_same_kind_of_thing():
    for name, fake in fake_items():
        real = getattr(pynvml, name, None)
        if real is None:
            continue  # test_every_name_the_fake_provides_is_in_the_real_module says so
        if _is_struct_name(name):
            assert isinstance(real, type) and issubclass(real, ctypes.Structure), name
            assert _struct_fields(fake) <= _struct_fields(real), \
                f"{name}: the fake has fields {sorted(_struct_fields(fake) - _struct_fields(real))} the real one lacks"
        elif isinstance(fake, type):
            assert isinstance(real, type) and issubclass(real, pynvml.NVMLError), name
            assert issubclass(fake, fake_names()["NVMLError"]), name
        elif _is_function(fake):
            assert _is_function(real), f"{name}: the fake's is a function, the real one {type(real).__name__}"
        else:
            assert type(fake) is type(real), (
                f"{name}: the fake's is {type(fake).__name__}, the real one {type(real).__name__}")


# ---- signatures ----------------------------------------------------------------------------------


def test_each_call_the_code_makes_binds_to_the_real_and_the_fake_signature():
    fakes_of: dict[str, list[Any]] = defaultdict(list)
    for name, value in fake_items():
        fakes_of[name].append(value)
    for name, counts in code_uses().items():
        if _is_struct_name(name):
            continue  # a ctypes struct, made empty: test_each_name_is_the_same_kind_of_thing
        real = getattr(pynvml, name, None)
        for count in counts:
            assert real is not None and _accepts(real, count), \
                f"{name} is called with {count} arguments; the real one is " \
                f"{name}{inspect.signature(real) if real else ' (missing)'}"
            for fake in fakes_of[name]:
                assert _accepts(fake, count), (
                    f"{name} is called with {count} arguments; the fake one takes {inspect.signature(fake)}")


def test_the_fake_accepts_no_call_the_real_one_refuses():
    for name, fake in fake_items():
        real = getattr(pynvml, name, None)
        if not _is_function(fake) or real is None:
            continue
        for count in range(6):
            if _accepts(fake, count):
                assert _accepts(real, count), \
                    f"{name}: the fake takes {count} arguments, the real one is {name}{inspect.signature(real)}"


# ---- constants and errors -----------------------------------------------------------------------


def test_the_fake_constants_have_the_real_values():
    for name, fake in fake_items():
        real = getattr(pynvml, name, None)
        if _is_function(fake) or isinstance(fake, type) or real is None:
            continue
        if name == "NVML_NVLINK_MAX_LINKS":  # an upper bound: the fake's boards have no more links than NVML can name
            assert fake <= real, f"{name}: the fake's {fake}, more than the real {real}"
        else:
            assert fake == real, f"{name}: the fake's {fake!r}, the real {real!r}"


def test_real_errors_are_what_the_code_catches():
    """Real NVML errors are raised as subclasses of NVMLError (picked by return code), which is
    what every `except nv.NVMLError` in discovery relies on."""
    for name in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission",
                 "NVMLError_GpuIsLost", "NVMLError_Timeout", "NVMLError_NotSupported", "NVMLError_InvalidArgument"):
        cls = getattr(pynvml, name)
        assert issubclass(cls, pynvml.NVMLError)
        assert isinstance(pynvml.NVMLError(cls().value), cls), name


# ---- return values, through the real wrappers ---------------------------------------------------


@pytest.fixture
def real_wrappers(monkeypatch):
    """The real module, its C functions replaced by one that succeeds and writes nothing."""
    asked: list[str] = []

    def lookup(name: str) -> Any:
        asked.append(name)
        return lambda *args: 0  # NVML_SUCCESS

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)
    return asked


def _kind(value: Any) -> str:
    if isinstance(value, bool | int):
        return "int"
    if isinstance(value, str | bytes | float):
        return type(value).__name__
    if value is None:
        return "None"
    if isinstance(value, ctypes._Pointer | ctypes.c_void_p):
        return "handle"
    return "struct"


def _check_value(name: str, fake: Any, real: Any) -> None:
    if _kind(real) == "handle":
        return  # an opaque handle: the fake's can be anything the fake itself understands
    if isinstance(fake, SimpleNamespace):
        assert _kind(real) == "struct", f"{name}: the fake returns a struct, the real one {type(real).__name__}"
        for attr, value in vars(fake).items():
            assert hasattr(real, attr), f"{name}: the fake's result has .{attr}, the real {type(real).__name__} has not"
            _check_value(f"{name}().{attr}", value, getattr(real, attr))
        return
    assert _kind(fake) == _kind(real), f"{name}: the fake returns {_kind(fake)}, the real one {_kind(real)} ({real!r})"


def test_what_the_fake_returns_has_the_real_shape(real_wrappers):
    fake = fake_names()
    called = 0
    for name, counts in sorted(code_uses().items()):
        if not _is_function(fake.get(name)) or name == "nvmlInit" or not counts:
            continue  # nvmlInit loads the library itself: its result is None either way
        count = max(counts)
        args = (0, 0, "event-set")[:count] if name == "nvmlDeviceRegisterEvents" else (0,) * count
        _check_value(name, fake[name](*args), getattr(pynvml, name)(*((0,) * count)))
        called += 1
    assert called >= 15 and len(set(real_wrappers)) >= 15


def test_real_strings_come_back_as_str_not_bytes(real_wrappers):
    """`str(...)` of bytes would be "b'GPU-…'": the code relies on these being str."""
    for name in ("nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlSystemGetDriverVersion"):
        fn = getattr(pynvml, name)
        assert isinstance(fn(*((0,) * len(inspect.signature(fn).parameters))), str), name
    assert isinstance(pynvml.nvmlDeviceGetPciInfo(0).busId, str)


def _version() -> str:
    from importlib.metadata import version

    return version("nvidia-ml-py")


def test_the_end_to_end_fake_module_matches_the_real_one_too():
    """tests/e2e/fake_pynvml.py (copied in as `pynvml` for the agent and `ctl doctor --local`
    processes) by the same rules: every NVML name it defines is in the real module, of the same
    kind, constants with the real values, no function taking an argument count the real refuses."""
    from tests.e2e import fake_pynvml

    names = {name: value for name, value in vars(fake_pynvml).items() if _is_nvml_name(name)}
    assert {"nvmlDeviceGetRemappedRows", "nvmlDeviceGetEccMode", "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"} <= set(names)
    for name, fake in names.items():
        real = getattr(pynvml, name, None)
        assert real is not None, f"tests/e2e/fake_pynvml.py defines {name}, nvidia-ml-py {_version()} has no such name"
        if _is_struct_name(name):
            assert isinstance(real, type) and _struct_fields(fake) <= _struct_fields(real), name
        elif isinstance(fake, type):
            assert isinstance(real, type) and issubclass(real, pynvml.NVMLError), name
        elif _is_function(fake):
            assert _is_function(real), name
            for count in range(6):
                if _accepts(fake, count):
                    assert _accepts(real, count), (
                        f"{name}: the e2e fake takes {count} arguments, the real one is {inspect.signature(real)}")
        elif name == "NVML_NVLINK_MAX_LINKS":
            assert fake <= real, name
        else:
            assert fake == real, f"{name}: the e2e fake's {fake!r}, the real {real!r}"
    missing = sorted(name for name in code_uses() if name not in names and name.startswith("nvmlDevice")
                     and name not in {"nvmlDeviceRegisterEvents", "nvmlDeviceGetIndex"})
    assert missing == [], f"the agent calls NVML functions the e2e fake lacks: {missing}"


# ---- what the code makes of the real answers (issue 39) ----------------------------------------


@functools.cache
def getattr_defaults() -> dict[str, set[Any]]:
    """`getattr(nv, "NVML_X", default)` in src/: the value the code assumes where a module lacks
    the name (constants only: a class's or a struct's stand-in is no value)."""
    found: dict[str, set[Any]] = defaultdict(set)
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and _is_nvml_name(node.args[1].value)
                    and isinstance(node.args[2], ast.Constant) and node.args[2].value is not None):
                found[node.args[1].value].add(node.args[2].value)
    return dict(found)


def test_every_default_the_code_assumes_is_the_real_value():
    defaults = getattr_defaults()
    assert {"NVML_FEATURE_ENABLED", "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"} <= set(defaults)
    for name, values in defaults.items():
        real = getattr(pynvml, name)
        for value in values:
            if name == "NVML_NVLINK_MAX_LINKS":  # Hopper's 18, for bindings older than the constant
                assert value <= real, name
            else:
                assert value == real, f"getattr(nv, {name!r}, {value!r}): nvidia-ml-py {_version()} says {real!r}"


def test_the_wire_names_nvmls_own_bits_and_states():
    """CLOCK_EVENTS and FABRIC_STATES (wire/messages.py) are NVML's values under nvidia-smi's names."""
    from llmgw.wire import messages as wire

    real_events = {
        pynvml.nvmlClocksEventReasonGpuIdle: "gpu_idle",
        pynvml.nvmlClocksEventReasonApplicationsClocksSetting: "applications_clocks",
        pynvml.nvmlClocksEventReasonSwPowerCap: "sw_power_cap",
        pynvml.nvmlClocksEventReasonHwSlowdown: "hw_slowdown",
        pynvml.nvmlClocksEventReasonSyncBoost: "sync_boost",
        pynvml.nvmlClocksEventReasonSwThermalSlowdown: "sw_thermal",
        pynvml.nvmlClocksEventReasonHwThermalSlowdown: "hw_thermal",
        pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "hw_power_brake",
        pynvml.nvmlClocksEventReasonDisplayClockSetting: "display_clocks",
    }
    assert real_events == wire.CLOCK_EVENTS
    # The older names carry the same bits (the agent falls back to them).
    assert pynvml.nvmlClocksThrottleReasonHwThermalSlowdown == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    real_states = {
        pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "not_supported",
        pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not_started",
        pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in_progress",
        pynvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
    }
    assert real_states == wire.FABRIC_STATES


def _out(ref: Any, value: int) -> None:
    ref._obj.value = value  # ctypes.byref(c_uint()): what the wrapper reads back


def _h100_with_faults() -> dict[str, Any]:
    """The C functions read_board's wrappers call, answering as an H100 SXM with faults would:
    a row remap pending (2 rows for uncorrectable errors), HW thermal slowdown, Gen4 x8 in a
    Gen5 x16 slot, ECC on but off after the next reset, the NVSwitch fabric set up."""

    def fabric(state: int, status: int) -> Any:
        def fill(device: Any, ref: Any) -> int:
            ref._obj.state, ref._obj.status = state, status
            return 0
        return fill

    def rows(device: Any, corr: Any, unc: Any, pending: Any, failed: Any) -> int:
        _out(corr, 5), _out(unc, 2), _out(pending, 1), _out(failed, 0)
        return 0

    def threshold(device: Any, kind: Any, ref: Any) -> int:
        _out(ref, {0: 92, 1: 89}.get(kind.value, 0))  # shutdown, slowdown (nvmlTemperatureThresholds_t)
        return 0

    def one(value: int) -> Any:
        def fill(device: Any, ref: Any) -> int:
            _out(ref, value)
            return 0
        return fill

    def ecc(device: Any, current: Any, pending: Any) -> int:
        _out(current, 1), _out(pending, 0)
        return 0

    return {
        "nvmlDeviceGetRemappedRows": rows,
        "nvmlDeviceGetCurrentClocksEventReasons": one(0x40 | 0x8),
        "nvmlDeviceGetCurrentClocksThrottleReasons": one(0x40 | 0x8),
        "nvmlDeviceGetTemperatureThreshold": threshold,
        "nvmlDeviceGetCurrPcieLinkGeneration": one(4), "nvmlDeviceGetMaxPcieLinkGeneration": one(5),
        "nvmlDeviceGetCurrPcieLinkWidth": one(8), "nvmlDeviceGetMaxPcieLinkWidth": one(16),
        "nvmlDeviceGetPersistenceMode": one(1),
        "nvmlDeviceGetEccMode": ecc,
        "nvmlDeviceGetGpuFabricInfoV": fabric(3, 0),
        "nvmlDeviceGetGpuFabricInfo": fabric(1, 0),
    }


def _real_board(monkeypatch, missing: tuple[str, ...] = ()) -> Any:
    from llmgw.agent import nvml_read
    from llmgw.wire.messages import GpuHealth

    answers = _h100_with_faults()

    def lookup(name: str) -> Any:
        if name in missing or name not in answers:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # what an older driver answers
        return answers[name]

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)
    health = GpuHealth(index=0)
    nvml_read.read_board(pynvml, 0, health)
    return health


def test_the_board_reading_takes_the_real_wrappers_answers_apart(monkeypatch):
    """read_board through the real nvidia-ml-py wrappers: the argument order each C function
    gets, and the tuple, list and struct each wrapper returns, taken apart as the code assumes."""
    h = _real_board(monkeypatch)
    assert (h.remapped_uncorrectable, h.remap_pending, h.remap_failed) == (2, True, False)
    assert h.retired_pages is None  # the row remapper answered: no page retirement asked
    assert h.clock_events == ["hw_slowdown", "hw_thermal"]
    assert (h.slowdown_c, h.shutdown_c) == (89, 92)
    assert (h.pcie_gen, h.pcie_gen_max, h.pcie_width, h.pcie_width_max) == (4, 5, 8, 16)
    assert (h.persistence, h.ecc_enabled, h.ecc_pending) == (True, True, False)
    assert (h.fabric_state, h.fabric_status) == ("completed", 0)  # the versioned call's struct


def test_a_driver_without_the_newer_calls_is_read_through_the_older_ones(monkeypatch):
    """nvmlDeviceGetGpuFabricInfoV (R550) and nvmlDeviceGetCurrentClocksEventReasons (R535) are
    missing from older drivers' libnvidia-ml: FunctionNotFound, then the deprecated calls."""
    h = _real_board(monkeypatch, missing=("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetCurrentClocksEventReasons"))
    assert (h.fabric_state, h.fabric_status) == ("not_started", 0)
    assert h.clock_events == ["hw_slowdown", "hw_thermal"]


@pytest.mark.parametrize(("missing", "temperature"), [((), 71), (("nvmlDeviceGetTemperatureV",), 65)])
def test_the_temperature_is_read_through_the_versioned_call_then_the_old_one(monkeypatch, missing, temperature):
    """nvml_health through the real wrappers, on a library that answers little else (every other
    query FunctionNotFound, which the code takes as "not read"): nvmlDeviceGetTemperatureV's
    c_nvmlTemperature_v1_t.temperature first, the deprecated call's out-parameter on older drivers."""
    from llmgw.agent import nvml_read

    def count(ref: Any) -> int:
        _out(ref, 1)
        return 0

    def versioned(device: Any, ref: Any) -> int:
        assert ref._obj.version == pynvml.nvmlTemperature_v1 and ref._obj.sensorType == pynvml.NVML_TEMPERATURE_GPU
        ref._obj.temperature = 71
        return 0

    def old(device: Any, sensor: Any, ref: Any) -> int:
        _out(ref, 65)
        return 0

    answers = {"nvmlDeviceGetCount_v2": count, "nvmlDeviceGetHandleByIndex_v2": lambda index, ref: 0,
               "nvmlDeviceGetTemperatureV": versioned, "nvmlDeviceGetTemperature": old}

    def lookup(name: str) -> Any:
        if name in missing or name not in answers:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return answers[name]

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)
    [health] = nvml_read.nvml_health(pynvml)
    assert (health.health, health.temperature_c, health.board_read) == ("ok", temperature, True)
