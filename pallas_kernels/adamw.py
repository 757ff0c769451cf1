"""Fused AdamW step: unscale + clip + AdamW (+ an optional bf16 param copy) in one pass, in place.

One kernel reads a gradient block (fp32 or bf16), the fp32 param, m and v blocks and a small
hyper-parameter vector, and writes param, m and v back into the same buffers
(``input_output_aliases``). The optimizer step is pure memory traffic, so one pass is the whole
game: 28 bytes/param with fp32 grads (26 with bf16), +2 for the bf16 copy.

Arithmetic follows ``optax.adamw`` operation by operation, so m and v are bitwise equal to it and
params agree to rounding (exactly, where the backend has an exact ``sqrt``):

    g  = float32(grad) / divisor               divisor = loss scale x clip factor (one number)
    m  = (1 - b1) * g + b1 * m                 (1 - b1) computed by the caller, as its optax would
    v  = (1 - b2) * g**2 + b2 * v
    u  = (m / bc1) / (sqrt(v / bc2 + eps_root) + eps) + weight_decay * p
    p  = p + u * (-lr)

and when ``skip`` is set (an fp16 overflow) every output keeps its input value.

Arrays are viewed as ``(rows, 128)``; blocks are ``(block_rows, 128)`` with ``block_rows`` a
power of two, the last block partial. Backends: ``"mosaic_gpu"`` (Hopper and newer; it has no
``sqrt`` lowering, so ``x * rsqrt(x)`` is used there), ``"triton"`` (older GPUs), ``"tpu"``
(Mosaic TPU; the hyper-parameters live in SMEM) and ``"interpret"`` (any backend, for tests).
"""
from __future__ import annotations

import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

LANES = 128
HYPER_SIZE = 32  # Mosaic GPU wants 32-float parameter vectors


class Hyper(enum.IntEnum):
    """Positions in the hyper-parameter vector (data, not constants: one compile serves all steps)."""

    LR = 0
    B1 = 1
    B2 = 2
    EPS = 3
    EPS_ROOT = 4
    WEIGHT_DECAY = 5
    BC1 = 6  # 1 - b1**t
    BC2 = 7  # 1 - b2**t
    DIVISOR = 8  # grads are divided by this (loss scale x clip factor)
    SKIP = 9  # > 0: keep every input unchanged
    ONE_MINUS_B1 = 10  # given, not computed: optax rounds 1 - b1 in float64 for Python floats
    ONE_MINUS_B2 = 11
    ZERO = 12  # always 0.0: a value the compiler cannot see (see _rounded_interpret)


BACKENDS = ("mosaic_gpu", "triton", "tpu", "interpret")
BLOCK_ROWS = {"triton": 64, "tpu": 512, "interpret": 1024}  # mosaic_gpu: from its shared memory
MOSAIC_GPU_SMEM = 192 * 1024  # of the 227 KiB an H100/H200 block may use; the rest for barriers
MOSAIC_GPU_STEPS = 2  # blocks in flight (pipelining) on Mosaic GPU


def hyper_vector(*, lr, b1, b2, eps, eps_root, weight_decay, count, divisor=1.0, skip=False) -> jax.Array:
    """The (32,) float32 vector the kernel reads. Scalars (arrays or numbers); ``count`` is the
    step number after this update (optax's ``count_inc``), for the bias corrections."""
    values = {Hyper.LR: lr, Hyper.B1: b1, Hyper.B2: b2, Hyper.EPS: eps, Hyper.EPS_ROOT: eps_root,
              Hyper.WEIGHT_DECAY: weight_decay, Hyper.BC1: 1 - b1**count, Hyper.BC2: 1 - b2**count,
              Hyper.DIVISOR: divisor, Hyper.SKIP: jnp.asarray(skip, jnp.float32),
              Hyper.ONE_MINUS_B1: 1 - b1, Hyper.ONE_MINUS_B2: 1 - b2}
    vec = jnp.zeros((HYPER_SIZE,), jnp.float32)
    for index, value in values.items():
        vec = vec.at[int(index)].set(jnp.asarray(value, jnp.float32))
    return vec


def fits(size: int) -> bool:
    """Whether a buffer of ``size`` elements has the kernel's (rows, 128) view without a copy."""
    return size > 0 and size % LANES == 0


def adamw(hyper: jax.Array, grad: jax.Array, param: jax.Array, m: jax.Array, v: jax.Array, *,
          backend: str, emit_bf16: bool = False, block_rows: int | None = None,
          steps_in_flight: int = MOSAIC_GPU_STEPS) -> tuple[jax.Array, ...]:
    """One fused AdamW step on a buffer of any shape whose size is a multiple of 128.

    Returns ``(param, m, v)`` (written into the buffers of the inputs) and, with ``emit_bf16``,
    a bf16 copy of the new param. ``param``, ``m`` and ``v`` are float32. ``block_rows`` (a
    power of two) and ``steps_in_flight`` (Mosaic GPU's pipelining depth) are tuning knobs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if not fits(param.size):
        raise ValueError(f"param: {param.size} elements is not a positive multiple of {LANES}")
    shape = param.shape
    rows = param.size // LANES
    block = min(block_rows or _default_block(backend, grad.dtype, emit_bf16, steps_in_flight),
                pl.next_power_of_2(rows))
    as_rows = [x.reshape(rows, LANES) for x in (grad, param, m, v)]
    tile = pl.BlockSpec((block, LANES), lambda i: (i, 0))
    f32 = jax.ShapeDtypeStruct((rows, LANES), jnp.float32)
    out_shape = (f32, f32, f32) + ((jax.ShapeDtypeStruct((rows, LANES), jnp.bfloat16),) if emit_bf16 else ())
    hyper_spec, params = _backend_specs(backend, steps_in_flight)
    outs = pl.pallas_call(
        _kernel(_SQRT[backend], _ROUNDED[backend], emit_bf16),
        out_shape=out_shape,
        grid=(pl.cdiv(rows, block),),
        in_specs=[hyper_spec, tile, tile, tile, tile],
        out_specs=tuple(tile for _ in out_shape),
        input_output_aliases={2: 0, 3: 1, 4: 2},
        interpret=backend == "interpret",
        compiler_params=params,
        name="jzero_fused_adamw",
    )(hyper, *as_rows)
    return tuple(x.reshape(shape) for x in outs)


def _kernel(sqrt: Callable[[jax.Array], jax.Array], rounded: Callable[[jax.Array, jax.Array], jax.Array],
            emit_bf16: bool):
    def kernel(hyper_ref, grad_ref, param_ref, m_ref, v_ref, param_out, m_out, v_out, *bf16_out):
        param_out[...], m_out[...], v_out[...] = step_math(
            hyper_ref, grad_ref[...], param_ref[...], m_ref[...], v_ref[...], sqrt=sqrt, rounded=rounded)
        if emit_bf16:
            bf16_out[0][...] = param_out[...].astype(jnp.bfloat16)

    return kernel


def step_math(hyper, grad: jax.Array, p: jax.Array, m_old: jax.Array, v_old: jax.Array, *,
              sqrt: Callable[[jax.Array], jax.Array] = jnp.sqrt,
              rounded: Callable[[jax.Array, jax.Array], jax.Array] | None = None) -> tuple[jax.Array, ...]:
    """The step's arithmetic on loaded values: ``(param, m, v)``. The kernel runs it per block;
    callers run it directly (under XLA) on buffers the kernel cannot view as (rows, 128).
    ``hyper`` is the hyper-parameter vector or a ref to it."""
    rounded = rounded or _as_is
    lr, b1, b2 = hyper[Hyper.LR], hyper[Hyper.B1], hyper[Hyper.B2]
    one_minus_b1, one_minus_b2 = hyper[Hyper.ONE_MINUS_B1], hyper[Hyper.ONE_MINUS_B2]
    eps, eps_root, weight_decay = hyper[Hyper.EPS], hyper[Hyper.EPS_ROOT], hyper[Hyper.WEIGHT_DECAY]
    bc1, bc2, divisor, zero = hyper[Hyper.BC1], hyper[Hyper.BC2], hyper[Hyper.DIVISOR], hyper[Hyper.ZERO]
    skip = hyper[Hyper.SKIP] > 0
    g = grad.astype(jnp.float32) / divisor  # unscaled in fp32, whatever the gradient's dtype
    m = rounded(one_minus_b1 * g, zero) + rounded(b1 * m_old, zero)
    v = rounded(one_minus_b2 * (g * g), zero) + rounded(b2 * v_old, zero)
    u = (m / bc1) / (sqrt(v / bc2 + eps_root) + eps) + rounded(weight_decay * p, zero)
    new_p = p + rounded(u * (-lr), zero)
    return jnp.where(skip, p, new_p), jnp.where(skip, m_old, m), jnp.where(skip, v_old, v)


def _rsqrt_sqrt(x: jax.Array) -> jax.Array:
    """sqrt for Mosaic GPU, which lowers rsqrt but not sqrt; exact 0 at 0."""
    return jnp.where(x > 0, x * jax.lax.rsqrt(x), 0.0)


def _rounded_interpret(product: jax.Array, zero: jax.Array) -> jax.Array:
    """``product`` rounded to float32 before it is added. XLA's CPU compiler always contracts
    a*b + c into an FMA (one rounding, not two), so the same formula gives different bits in
    different fusions (optimization barriers are removed before that happens). XOR-ing the bits
    with a zero read at run time hides the product from the contraction. Interpret mode only, so
    the CPU tests compare bitwise against optax run op by op; GPU/TPU compilers may contract
    (more accurate, not bitwise optax)."""
    bits = jax.lax.bitcast_convert_type(product, jnp.int32) ^ jax.lax.bitcast_convert_type(zero, jnp.int32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _as_is(product: jax.Array, zero: jax.Array) -> jax.Array:
    del zero
    return product


_ROUNDED = {"mosaic_gpu": _as_is, "triton": _as_is, "tpu": _as_is, "interpret": _rounded_interpret}
_SQRT = {"mosaic_gpu": _rsqrt_sqrt, "triton": jnp.sqrt, "tpu": jnp.sqrt, "interpret": jnp.sqrt}


def _default_block(backend: str, grad_dtype, emit_bf16: bool, steps_in_flight: int) -> int:
    """Rows per block: a fixed power of two, or on Mosaic GPU the largest whose buffers
    (every operand, ``steps_in_flight`` deep) fit its shared-memory budget."""
    if backend != "mosaic_gpu":
        return BLOCK_ROWS[backend]
    row_bytes = LANES * (jnp.dtype(grad_dtype).itemsize + 6 * 4 + (2 if emit_bf16 else 0)) * steps_in_flight
    return 1 << (MOSAIC_GPU_SMEM // row_bytes).bit_length() - 1


def _backend_specs(backend: str, steps_in_flight: int):
    """(BlockSpec of the hyper-parameter vector, compiler params) for ``backend``."""
    whole = pl.BlockSpec((HYPER_SIZE,), lambda i: (0,))
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pl.BlockSpec(memory_space=pltpu.SMEM), pltpu.CompilerParams(dimension_semantics=("parallel",))
    if backend == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return whole, plgpu.CompilerParams(max_concurrent_steps=steps_in_flight)
    if backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        return whole, pltriton.CompilerParams(num_warps=4, num_stages=1)
    return whole, None
