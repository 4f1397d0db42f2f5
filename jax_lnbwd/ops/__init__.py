"""The FFI ops and the mechanisms every norm shares: ffi.py (registration, the one call
builder), forward.py (the fused forward op), backward.py (the backward op), partition.py
(their rule under sharding), qk.py (QK-norm's calls: q's and k's heads in one, bare for now)."""
