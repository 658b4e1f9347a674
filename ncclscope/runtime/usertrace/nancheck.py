"""Where a NaN came from: a finiteness check on what a rank puts INTO a reduction.

Why: a NaN in one rank's batch spreads through the gradient all-reduce to
every rank within one step; afterwards every rank's loss, gradients and
parameters are NaN and nothing in the trace says which rank it came from.
Before the reduction only the rank it came from holds it. So the tracer looks
at the input of every reducing collective (all_reduce, reduce, reduce_scatter,
reduce_scatter_tensor, all_reduce_coalesced) on floating tensors, and at each
gradient of a DistributedDataParallel module the moment autograd has
accumulated it (`Tensor.register_post_accumulate_grad_hook`, installed by a
patched `DistributedDataParallel.__init__`: the reducer's all-reduces run in
C++, where no Python wrapper sees them; the tensor hook runs inside autograd's
AccumulateGrad, before the reducer's own hook marks the gradient ready, so the
value seen is the rank's own). A user's `register_comm_hook` is untouched.

The first non-finite input on a rank writes ONE marker row, named
`nonfinite` (the marker the built-in runtime writes at the origin), with the
step, the op or parameter and the counts; then the rank stops checking: later
NaNs are the first one's consequences. The analyzer
(ncclscope/perf/divergence.py) names the earliest marker in happens-before.

Cost, healthy tensors: one sum (NaN and Inf propagate through a sum, so a
finite sum proves a finite tensor; only a non-finite sum, or a finite tensor
whose sum overflows, pays the exact count). A small one-dimensional tensor
(<= SMALL elements: losses, counters, metrics) is summed as Python floats
(`tolist`, ~0.6 us for 4 floats): a torch `sum()` is ~3 us in a loop but, between
two gloo collectives on a loaded 2-core machine, measured ~20 us (it releases
the GIL and the worker threads' handoff pays for it). Larger tensors take the
torch sum, small next to the op itself (1 MB: ~20 us against ~3.5 ms).
Measured by benchmarks/run_overhead.py --only nan (the check's own line).

Modes (`ncclscope run --nan-check / --no-nan-check`, NCCLSCOPE_NAN_CHECK=auto|on|off):
    auto  CPU tensors only (default): reading a CUDA tensor's sum forces a device sync
    on    every device, CUDA included (each checked op then waits for its input)
    off   no check
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

from ncclscope import schema as S

from ncclscope.runtime.usertrace.callsite import call_site

MARKER = "nonfinite"
MODES = ("auto", "on", "off")
ENV = "NCCLSCOPE_NAN_CHECK"
# the collectives that combine the ranks' values: a NaN in one rank's input reaches every rank's output
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced"})
# up to this many elements (one dimension at most) the values are summed as Python floats (`tolist`): a
# torch op releases the GIL and, between two collectives, costs several times its own ~3 us in situ
SMALL = 128
# half types overflow a sum of finite values long before float32 does: accumulate those in float32
_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def mode_from_env(default: str = "auto") -> str:
    m = os.environ.get(ENV, default).strip().lower() or default
    return m if m in MODES else default


def nonfinite_counts(t: Any, nan_only: bool = False, any_device: bool = False) -> tuple[int, int] | None:
    """(NaN count, Inf count) of a floating tensor holding a non-finite value, else None (finite, not
    floating, on a device not checked, or not readable: a meta or fake tensor). `nan_only` ignores
    infinities (a MAX/MIN reduction's -inf/+inf identity is legitimate)."""
    try:
        if not t.is_floating_point() or not (any_device or t.is_cpu):
            return None
        if t.requires_grad:
            t = t.detach()
        if t.dim() <= 1 and t.numel() <= SMALL:   # Python floats: no torch op (see the module docstring)
            v = t.tolist()
            s = sum(v) if isinstance(v, list) else v
        else:
            acc = _ACC.get(t.dtype)
            s = float(t.sum() if acc is None else t.sum(dtype=acc))
        if s - s == 0.0:   # finite (inf - inf and nan - nan are nan)
            return None
        n_nan = int(torch.isnan(t).sum())
        n_inf = 0 if nan_only else int(torch.isinf(t).sum())
    except Exception:   # never the tracer's error in the user's job
        return None
    return (n_nan, n_inf) if (n_nan or n_inf) else None


def small_kind(shape: Any, dtype: Any) -> bool:
    """Whether a tensor of this shape and dtype takes `nonfinite_counts`' Python-float path (cached by the
    hot path per (shape, dtype), so that a healthy small tensor costs one dict hit, `tolist` and `sum`)."""
    return bool(dtype.is_floating_point) and len(shape) <= 1 and (shape[0] if len(shape) else 1) <= SMALL


def _describe(t: Any) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


class NanCheckMixin:
    """The check's state and the DDP hook; one facet of `tracer.Tracer`."""
    rec: Any
    nan_mode: str            # auto | on | off
    _nan_live: bool          # still checking: no marker written on this rank yet

    def nan_check_for(self, op_name: str) -> bool:
        """Whether op `op_name`'s wrapper checks its input (resolved once per wrapper, at install)."""
        return self.nan_mode != "off" and op_name in REDUCING

    def check_input(self, t: Any, op_name: str, group: str, seq: int, reduce_op: str, site: str) -> bool:
        """Check a reduction's input (a tensor or a list of tensors) before the call; on the first
        non-finite one, write the marker and stop checking. True when it wrote the marker."""
        nan_only = reduce_op.startswith(("max", "min"))
        any_device = self.nan_mode == "on"
        ts = t if isinstance(t, (list, tuple)) else (t,)
        for i, x in enumerate(ts):
            if not isinstance(x, torch.Tensor):
                continue
            bad = nonfinite_counts(x, nan_only, any_device)
            if bad is not None:
                which = f"[{i}] " if len(ts) > 1 else ""
                seq_s = f" #{seq}" if seq >= 0 else ""
                self._nonfinite(f"input {which}to {op_name} on {group}{seq_s} ({_describe(x)}): {bad[0]} NaN, "
                                f"{bad[1]} Inf, before the reduction", site)
                return True
        return False

    def _nonfinite(self, message: str, site: str = "") -> None:
        if not self._nan_live:
            return
        self._nan_live = False
        try:
            self.rec.instant(S.KIND_MARKER, MARKER, message=message[:500], call_site=site)
        except Exception:
            pass

    # ---- DDP: its reducer all-reduces in C++ ------------------------------------
    def _wrap_ddp_init(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """DistributedDataParallel.__init__, then a post-accumulate-grad hook on each parameter it reduces."""
        tracer = self

        @functools.wraps(orig)
        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            orig(ddp, *args, **kwargs)
            if tracer.nan_mode != "off" and tracer._nan_live:
                try:
                    tracer.watch_ddp(ddp)
                except Exception:   # the user's model is theirs: never fail its construction
                    pass
        return __init__

    def watch_ddp(self, ddp: Any) -> int:
        """Hook every floating parameter of `ddp.module` that DDP reduces; the number hooked."""
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        any_device = self.nan_mode == "on"
        n = 0
        for name, p in ddp.module.named_parameters():
            if not p.requires_grad or name in ignored or not p.is_floating_point():
                continue
            if not (any_device or p.is_cpu):
                continue
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, name))
            n += 1
        return n

    def _grad_ready(self, name: str, p: Any) -> None:
        """A parameter's gradient is accumulated, the reducer has not seen it yet. After the first
        marker, one attribute test (hooks are not removed from inside autograd's own loop)."""
        if not self._nan_live or p.grad is None:
            return
        bad = nonfinite_counts(p.grad, False, self.nan_mode == "on")
        if bad is not None:
            self._nonfinite(f"gradient of {name} ({_describe(p.grad)}) before DDP's all-reduce: {bad[0]} NaN, "
                            f"{bad[1]} Inf", call_site())

    def install_nan_check(self, patch: Callable[[list[Any], str, Any, Any], None]) -> None:
        """Patch DistributedDataParallel.__init__ (through the tracer's `_patch`, undone by uninstall)."""
        if self.nan_mode == "off":
            return
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
        except ImportError:
            return
        if "__init__" in DDP.__dict__:
            patch([DDP], "__init__", DDP.__dict__["__init__"], self._wrap_ddp_init(DDP.__dict__["__init__"]))
