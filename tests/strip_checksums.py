"""Rewrites a safetensors file without mha's checksums, as another tool writes it:
python3 strip_checksums.py IN OUT."""
import json
import struct
import sys

data = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", data[:8])
header = json.loads(data[8:8 + n])
meta = header.get("__metadata__", {})
header["__metadata__"] = {k: v for k, v in meta.items() if not k.startswith("crc32:")}
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(text)) + text + data[8 + n:])
