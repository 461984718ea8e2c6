"""`linear`, the one entry point of fastppl's fused paths to a product: x @ weight^T with an optional bias, GELU
epilogue or in-place accumulation. It is torch's own call, unless a product tuner runs (`--tune-products on`:
fastppl.accel.cublaslt), which then gives each product shape cuBLASLt's fastest one-pass candidate."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cublaslt import (ALIGNMENT, EPILOGUE_BIAS, EPILOGUE_DEFAULT, EPILOGUE_GELU, EPILOGUE_GELU_BIAS, LinearPlan,
                       Product, ProductTuner)

_tuner: Optional[ProductTuner] = None


def start_tuning(store: Optional[Path], timing_allowed: bool = True) -> ProductTuner:
    """Route `linear` through tuned cuBLASLt plans from now on (until stop_tuning)."""
    global _tuner
    _tuner = ProductTuner(store, timing_allowed)
    return _tuner


def stop_tuning() -> None:
    global _tuner
    _tuner = None


def _aligned(*tensors: Optional[torch.Tensor]) -> bool:
    return all(t is None or t.data_ptr() % ALIGNMENT == 0 for t in tensors)


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gelu: bool,
                  accumulate_into: Optional[torch.Tensor]) -> torch.Tensor:
    if accumulate_into is not None:
        return accumulate_into.addmm_(x, weight.t())
    if gelu:
        if x.is_cuda and bias is not None:   # cuBLASLt's GELU epilogue is the tanh one; on the CPU it is erf's
            return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, gelu: bool = False,
           accumulate_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T, plus bias, then GELU (tanh approximation, GPT-2's) when gelu; or, with
    accumulate_into (M, N), added into it in place (no bias, no GELU). torch's own call unless a tuner runs."""
    assert accumulate_into is None or (bias is None and not gelu)
    tuner = _tuner
    if tuner is None or tuner.failure or not x.is_cuda or x.device.index != torch.cuda.current_device() \
            or not all(t.is_contiguous() for t in (x, weight, *(t for t in (bias, accumulate_into) if t is not None))) \
            or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype) \
            or not _aligned(x, weight, bias, accumulate_into):
        return _torch_linear(x, weight, bias, gelu, accumulate_into)
    if accumulate_into is not None:
        epilogue, beta = EPILOGUE_DEFAULT, 1.0
    else:
        epilogue, beta = ((EPILOGUE_GELU if gelu else EPILOGUE_DEFAULT) if bias is None else
                          (EPILOGUE_GELU_BIAS if gelu else EPILOGUE_BIAS)), 0.0
    key = (x.shape[0], weight.shape[0], weight.shape[1], x.dtype, epilogue, beta)
    plan = tuner.plans.get(key, ...)
    if plan is ...:   # first call of this shape: tune (or look up) on these operands
        scratch = {}

        def fresh_start() -> Optional[torch.Tensor]:
            return None if accumulate_into is None else accumulate_into.clone()

        def candidate_timed(p: LinearPlan, i: int) -> torch.Tensor:
            if accumulate_into is None:
                return p.run(x, weight, bias, index=i)
            if "out" not in scratch:   # candidates add into one copy, so that the real sum gets one product
                scratch["out"] = accumulate_into.clone()
            return p.run(x, weight, out=scratch["out"], index=i)

        plan = tuner.plan(Product(
            key, lambda: _torch_linear(x, weight, bias, gelu, fresh_start()),
            lambda p, i: p.run(x, weight, bias, out=fresh_start(), index=i), candidate_timed))
    if plan is None:
        return _torch_linear(x, weight, bias, gelu, accumulate_into)
    try:
        return plan.run(x, weight, bias, out=accumulate_into)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        tuner.fail(error)
        return _torch_linear(x, weight, bias, gelu, accumulate_into)


def _tuned_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    # the width, not -1: there is no size to infer from 0 rows
    return linear(x.reshape(-1, shape[-1]), self.weight, self.bias).view(*shape[:-1], self.weight.shape[0])


def route_linears(model: nn.Module) -> int:
    """Send every nn.Linear's forward through `linear` (tuned while a tuner runs); returns how many."""
    routed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = _tuned_linear_forward.__get__(module)
            routed += 1
    return routed


def unroute_linears(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is nn.Linear and "forward" in module.__dict__:
            del module.forward
