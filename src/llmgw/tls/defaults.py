"""Certificate defaults the CLI shows in its options: no cryptography import here."""

from __future__ import annotations

from typing import Literal, get_args

KeyType = Literal["ecdsa-p256", "rsa-3072", "ed25519"]
KEY_TYPES: tuple[str, ...] = get_args(KeyType)
DEFAULT_KEY_TYPE: KeyType = "ecdsa-p256"
DEFAULT_CA_NAME = "llmgw CA"
CA_DAYS = 3650
LEAF_DAYS = 365
