#!/usr/bin/python3
"""PyTorch checkpoint <-> .safetensors with edgetrain's tensor names (Debian's python3-torch).

  convert_pytorch.py IN.pt OUT.safetensors          # import: for model.weights
  convert_pytorch.py --to-pytorch IN.safetensors OUT.pt   # export: a state_dict for load_state_dict

Import reads a checkpoint as people publish them: a bare state_dict, or a dict holding it under
"state_dict", "model", "net" or "model_state_dict" (other entries, such as an optimizer or the
best accuracy, are ignored), with or without DataParallel's "module." prefix. Floating-point
tensors are written as F32 under their state_dict names, which are edgetrain's parameter and
buffer names; BN "num_batches_tracked" counters are dropped (edgetrain uses a fixed momentum).
Loading unpickles tensors, containers and plain values only (pickled code is refused);
--unsafe-pickle allows a checkpoint that pickles a whole nn.Module (run it only on files you trust).

--to-pytorch writes a state_dict (an OrderedDict of tensors) and adds each BN's
num_batches_tracked (0), so that model.load_state_dict(torch.load(OUT)) works with strict=True.

Both directions write OUT through a temporary file and a rename: a failure leaves nothing behind.
Errors name the file and, where there is one, the tensor, and exit with status 1.
"""
import argparse
import collections
import json
import os
import struct
import sys

COUNTER = ".num_batches_tracked"
CONTAINER_KEYS = ("state_dict", "model", "net", "model_state_dict")


class ConvertError(Exception):
    pass


def fail(msg):
    raise ConvertError(msg)


def unwrap(obj, path):
    """The state_dict inside a published checkpoint."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if not isinstance(obj, dict):
        fail("%s: holds a %s, not a state_dict or a dict holding one" % (path, type(obj).__name__))
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    for key in CONTAINER_KEYS:
        if key in obj:
            return unwrap(obj[key], "%s['%s']" % (path, key))
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        fail("%s: no tensors and none of the keys %s (keys: %s)" % (path, ", ".join(CONTAINER_KEYS),
                                                                      ", ".join(map(str, list(obj)[:10]))))
    return tensors


def write_atomically(path, write):
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        fail("cannot write %s: %s" % (path, e.strerror or e))


def restricted_pickle():
    """A pickle module for torch.load that builds tensors, containers and plain values only.
    (torch 1.13's weights_only=True refuses floats, which published checkpoints hold, e.g. an
    accuracy next to the state_dict.)"""
    import collections as _c
    import pickle
    import types

    import torch

    allowed = {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
               ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
               ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("builtins", "set"),
               ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex")}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in allowed or (module == "torch" and name.endswith("Storage")) or \
                    (module == "torch" and name in ("float32", "float16", "bfloat16", "float64", "int64", "int32",
                                                     "uint8", "int8", "bool")):
                return super().find_class(module, name)
            raise pickle.UnpicklingError("refusing to load %s.%s (not a tensor or plain value)" % (module, name))

    def load(f, **kw):
        return Unpickler(f, **kw).load()

    del _c, torch
    return types.SimpleNamespace(Unpickler=Unpickler, load=load, __name__="restricted_pickle")


def safe_load(path):
    """torch.load through restricted_pickle(). torch 1.13's torch.load replaces any pickle_module
    by pickle unless weights_only=True (whose unpickler refuses floats), so this calls the loaders
    torch.load itself uses; other torch versions get torch.load(weights_only=True)."""
    import torch
    import torch.serialization as ser

    if not all(hasattr(ser, f) for f in ("_is_zipfile", "_open_zipfile_reader", "_load", "_legacy_load")):
        return torch.load(path, map_location="cpu", weights_only=True)
    module = restricted_pickle()
    with open(path, "rb") as f:
        if ser._is_zipfile(f):
            with ser._open_zipfile_reader(f) as z:
                return ser._load(z, "cpu", module, encoding="utf-8")
        return ser._legacy_load(f, "cpu", module, encoding="utf-8")


def to_safetensors(src, dst, unsafe):
    import torch

    try:
        obj = torch.load(src, map_location="cpu") if unsafe else safe_load(src)
    except FileNotFoundError:
        fail("%s: no such file" % src)
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        hint = "" if unsafe else " (if it pickles a whole model and you trust it: --unsafe-pickle)"
        fail("%s: not a readable PyTorch checkpoint: %s%s" % (src, str(e).splitlines()[0] if str(e) else type(e).__name__, hint))
    sd = unwrap(obj, src)
    names = list(sd)
    if names and all(n.startswith("module.") for n in names):
        sd = collections.OrderedDict((n[len("module."):], sd[n]) for n in names)
    header, blobs, offset, dropped = {}, [], 0, 0
    for name, t in sd.items():
        if name.endswith(COUNTER):
            dropped += 1
            continue
        if not isinstance(t, torch.Tensor):
            fail("%s: entry '%s' is a %s, not a tensor" % (src, name, type(t).__name__))
        if not t.is_floating_point():
            fail("%s: tensor '%s' is %s, a floating-point tensor is needed" % (src, name, t.dtype))
        data = t.detach().to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if not header:
        fail("%s: no floating-point tensors" % src)
    header["__metadata__"] = {"format": "pt", "producer": "edgetrain convert_pytorch.py", "source": os.path.basename(src)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)

    write_atomically(dst, write)
    print("wrote %s: %d tensors%s" % (dst, len(blobs), " (%d num_batches_tracked dropped)" % dropped if dropped else ""))


def read_safetensors(src):
    """[(name, dtype, shape, bytes)] in data order, checked against the file's size."""
    try:
        with open(src, "rb") as f:
            raw = f.read()
    except OSError as e:
        fail("%s: %s" % (src, e.strerror or e))
    if len(raw) < 8:
        fail("%s: too short for a safetensors header" % src)
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        fail("%s: header length %d exceeds the file (truncated?)" % (src, n))
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        fail("%s: unreadable header: %s" % (src, e))
    data = raw[8 + n:]
    out = []
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            fail("%s: tensor '%s': needs dtype, shape and data_offsets" % (src, name))
        if dtype not in sizes:
            fail("%s: tensor '%s' is %s, a floating-point dtype is needed" % (src, name, dtype))
        count = 1
        for d in shape:
            count *= d
        if not (0 <= b <= end <= len(data)) or end - b != count * sizes[dtype]:
            fail("%s: tensor '%s': data_offsets [%d, %d] do not fit its shape or the file" % (src, name, b, end))
        out.append((b, name, dtype, shape, data[b:end]))
    return [x[1:] for x in sorted(out)]


def to_pytorch(src, dst):
    import torch

    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    sd = collections.OrderedDict()
    for name, dtype, shape, data in read_safetensors(src):
        t = torch.frombuffer(bytearray(data), dtype=dtypes[dtype]) if data else torch.empty(0, dtype=dtypes[dtype])
        sd[name] = t.reshape(shape).to(torch.float32).clone()
        if name.endswith(".running_var"):  # the last BN entry PyTorch writes: its counter follows
            sd[name[:-len(".running_var")] + COUNTER] = torch.tensor(0, dtype=torch.long)
    write_atomically(dst, lambda f: torch.save(sd, f))
    print("wrote %s: %d entries" % (dst, len(sd)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--to-pytorch", action="store_true", help="safetensors -> PyTorch state_dict")
    ap.add_argument("--unsafe-pickle", action="store_true", help="allow pickled code in IN (trusted files only)")
    ap.add_argument("--force", action="store_true", help="replace DST if it exists")
    a = ap.parse_args()
    try:
        if os.path.exists(a.dst) and not a.force:
            fail("%s exists (--force replaces it)" % a.dst)
        if a.to_pytorch:
            to_pytorch(a.src, a.dst)
        else:
            to_safetensors(a.src, a.dst, a.unsafe_pickle)
    except ConvertError as e:
        print("convert_pytorch.py: error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
