"""Catch CPU/accelerator device mix-ups on a machine without a GPU.

:class:`EmulatedAccelerator` is a ``TorchFunctionMode`` that treats ``torch.device("cpu", 0)``
(``DEVICE``) as if it were a CUDA device: every tensor gets a tag, ``dev`` (made on or moved
to ``DEVICE``, or computed from a ``dev`` tensor) or ``host`` (``torch.from_numpy``, a factory
function without ``device=``, ``.cpu()``), and an operation that mixes a ``dev`` tensor with a
``host`` tensor of one or more dimensions raises, as CUDA does ("Expected all tensors to be
on the same device"). 0-d host tensors mix freely (as CPU scalars do with CUDA tensors);
copies, moves and indexing with host indices are allowed (as on CUDA). Parameters and
buffers of a module moved with ``module.to(DEVICE)`` are ``dev`` (``Tensor.data`` assignment
carries the tag), and a module's forward refuses ``host`` inputs.

Use it with ``tasks.env.resolve_device`` patched to return ``DEVICE``, so that the
code under test believes it runs on an accelerator (see tests/test_conformance.py). A test
that passes under it on CPU does what the same code does on a CUDA device, as far as device
placement goes (it cannot see kernels that exist only on one device).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

DEVICE = torch.device("cpu", 0)
_TAG = "_emulated_device"
_MOVES = {"to", "cuda", "cpu", "copy_", "__get__", "__set__", "__getitem__", "__setitem__", "index_put_",
          "numpy", "item", "tolist", "_has_compatible_shallow_copy_type", "is_floating_point", "_parse_to",
          "new_tensor", "detach", "requires_grad_", "size", "dim", "numel", "__len__", "__repr__",
          "__format__", "__bool__", "__float__", "__int__", "__index__", "storage_offset", "data_ptr"}
_FACTORIES = {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "full", "empty", "arange", "linspace",
              "rand", "randn", "randint", "randperm", "eye", "zeros_like", "ones_like", "full_like",
              "empty_like", "rand_like", "randn_like", "randint_like"}


class DeviceMixError(RuntimeError):
    pass


def tag_of(t) -> str | None:
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


def _set(t, tag: str | None) -> None:
    if isinstance(t, torch.Tensor) and tag is not None:
        try:
            setattr(t, _TAG, tag)
        except (AttributeError, RuntimeError):
            pass


def _device_arg(args, kwargs):
    dev = kwargs.get("device")
    if dev is None:
        for a in args[1:]:
            if isinstance(a, (torch.device, str)):
                dev = a
                break
    if dev is None:
        return None
    try:
        return torch.device(dev)
    except (RuntimeError, TypeError):
        return None


def _is_dev(d: torch.device | None) -> bool:
    return d is not None and d.type == "cpu" and d.index == 0


class EmulatedAccelerator(TorchFunctionMode):
    """See the module docstring. ``violations`` lists what raised (the first one is raised)."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        tags = {tag_of(t) for t in tensors}
        if name not in _MOVES and "dev" in tags:
            host = [t for t in tensors if tag_of(t) == "host" and t.dim() > 0]
            if host:
                msg = (f"{name}: a tensor on the (emulated) accelerator meets a CPU tensor of shape "
                       f"{tuple(host[0].shape)}; move it with .to(device) first")
                self.violations.append(msg)
                raise DeviceMixError(msg)
        out = func(*args, **kwargs)
        # what the result is
        if name == "__set__" and len(args) == 2 and isinstance(args[0], torch.Tensor):  # p.data = q
            _set(args[0], tag_of(args[1]))
            return out
        if name in ("to", "cuda", "new_tensor") or name in _FACTORIES:
            d = _device_arg(args, kwargs)
            if name == "cuda":
                tag = "dev"
            elif _is_dev(d):
                tag = "dev"
            elif d is None:
                tag = "host" if name in _FACTORIES and name not in ("zeros_like", "ones_like", "full_like",
                                                                     "empty_like", "rand_like", "randn_like",
                                                                     "randint_like") else None
                if tag is None:  # keeps the input's place (x.to(dtype), zeros_like(x))
                    tag = "dev" if "dev" in tags else ("host" if "host" in tags else None)
            else:
                tag = None  # an explicit plain device (e.g. x.device): neutral, never a false alarm
            if isinstance(out, torch.Tensor) and tensors and out is tensors[0] and tag != tag_of(out):
                out = out.view_as(out)
            _set(out, tag)
            return out
        if name == "cpu":
            if isinstance(out, torch.Tensor) and tensors and out is tensors[0]:
                out = out.view_as(out)
            _set(out, "host")
            return out
        if name in ("__get__", "detach", "__getitem__", "clone") or name not in _MOVES:
            tag = "dev" if "dev" in tags else ("host" if "host" in tags else None)
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and tag_of(o) is None:
                    _set(o, tag)
        return out


def _module_to(orig):
    def to(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        d = _device_arg((None, *args), kwargs)
        if _is_dev(d):
            for t in list(self.parameters()) + list(self.buffers()):
                _set(t, "dev")
        return out
    return to


def _forward_pre_hook(module, inputs):
    params = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    if any(tag_of(p) == "dev" for p in params):
        for x in tree_flatten(inputs)[0]:
            if tag_of(x) == "host" and x.dim() > 0:
                raise DeviceMixError(f"{type(module).__name__}: its weights are on the (emulated) accelerator "
                                     f"but an input of shape {tuple(x.shape)} is on the CPU")
    return None


class emulated_accelerator:
    """Context manager: the mode, ``Module.to`` tagging and the forward check."""

    def __enter__(self) -> EmulatedAccelerator:
        self._orig = torch.nn.Module.to
        torch.nn.Module.to = _module_to(self._orig)
        self._from_numpy = torch.from_numpy  # not routed through torch-function modes

        def from_numpy(a):
            t = self._from_numpy(a)
            _set(t, "host")
            return t

        torch.from_numpy = from_numpy
        self._deepcopy = torch.nn.Parameter.__deepcopy__

        def deepcopy(param, memo):  # a copied module (e.g. a per-client server copy) stays where it was
            out = self._deepcopy(param, memo)
            _set(out, tag_of(param))
            return out

        torch.nn.Parameter.__deepcopy__ = deepcopy
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(_forward_pre_hook)
        self.mode = EmulatedAccelerator()
        self.mode.__enter__()
        return self.mode

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        self._hook.remove()
        torch.nn.Module.to = self._orig
        torch.from_numpy = self._from_numpy
        torch.nn.Parameter.__deepcopy__ = self._deepcopy
