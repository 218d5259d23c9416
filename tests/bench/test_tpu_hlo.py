"""bench.tpu_hlo: a compiled TPU program's bytes by memory space, by XLA's counting rules
(a fusion reads its operands' slices, updates in place write the update, a conditional
counts at its costliest branch), HBM's alone where arrays sit in VMEM, and the figure
with named scopes' branches not taken. A hand-written module: no compile."""

# ruff: noqa: E501 (the HLO's lines as XLA prints them)
from __future__ import annotations

import pytest

from bench.tpu_hlo import traffic

MODULE = """\
HloModule step

%squeeze (param_0.2: bf16[4,256,128], param_1.2: s32[]) -> bf16[256,128] {
  %param_0.2 = bf16[4,256,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.2 = s32[]{:T(128)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  %ds = bf16[1,256,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%param_0.2, %param_1.2, %zero, %zero), dynamic_slice_sizes={1,256,128}
  ROOT %squeezed = bf16[256,128]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

%fused_slice (param_0: bf16[4,256,128], param_1: s32[]) -> bf16[256,128] {
  %param_0 = bf16[4,256,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[]{:T(128)} parameter(1)
  ROOT %nested = bf16[256,128]{1,0:T(8,128)(2,1)} fusion(%param_0, %param_1), kind=kLoop, calls=%squeeze
}

%fused_update (param_0.1: f32[64,128], param_1.1: f32[8,128], param_2: s32[]) -> f32[64,128] {
  %param_0.1 = f32[64,128]{1,0:T(8,128)} parameter(0)
  %param_1.1 = f32[8,128]{1,0:T(8,128)} parameter(1)
  %param_2 = s32[]{:T(128)} parameter(2)
  %zero.1 = s32[]{:T(128)} constant(0)
  ROOT %dus = f32[64,128]{1,0:T(8,128)} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %zero.1)
}

%bias (p.0: f32[64,128]) -> f32[64,128] {
  %p.0 = f32[64,128]{1,0:T(8,128)} parameter(0)
  ROOT %negate = f32[64,128]{1,0:T(8,128)} negate(%p.0), metadata={op_name="jit(step)/cond/sampling_logit_bias/neg"}
}

%identity (p.1: f32[64,128]) -> f32[64,128] {
  ROOT %p.1 = f32[64,128]{1,0:T(8,128)} parameter(0)
}

ENTRY %main (w: bf16[4,256,128], i: s32[], x: f32[64,128], u: f32[8,128], c: pred[]) -> f32[64,128] {
  %w = bf16[4,256,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[]{:T(128)} parameter(1)
  %x = f32[64,128]{1,0:T(8,128)} parameter(2)
  %u = f32[8,128]{1,0:T(8,128)} parameter(3)
  %c = pred[]{:T(512)} parameter(4)
  %layer = bf16[256,128]{1,0:T(8,128)(2,1)S(1)} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %start = (f32[8,128]{1,0:T(8,128)}, f32[8,128]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%u)
  %staged = f32[8,128]{1,0:T(8,128)S(1)} copy-done(%start)
  %updated = f32[64,128]{1,0:T(8,128)} fusion(%x, %staged, %i), kind=kLoop, calls=%fused_update
  %kernel = f32[64,128]{1,0:T(8,128)} custom-call(%updated, %w), custom_call_target="tpu_custom_call"
  ROOT %out = f32[64,128]{1,0:T(8,128)} conditional(%c, %kernel, %kernel), branch_computations={%identity, %bias}
}
"""

LAYER = 256 * 128 * 2  # one layer's slice of w, bf16
ROWS = 8 * 128 * 4  # u, f32
LOGITS = 64 * 128 * 4
INDEX = 4  # the s32 scalar a fusion reads as an index


def test_bytes_by_memory_space_and_without_a_scoped_branch() -> None:
    t = traffic(MODULE, ("sampling_logit_bias",))
    # the slice (in a nested fusion) read from HBM, written to VMEM; u copied in (both
    # ends), read from VMEM
    # and written into x's update in place; the kernel counts nothing (its own rules);
    # the conditional at its costliest branch, the negation's read and write
    every = 2 * LAYER + 2 * ROWS + (ROWS + ROWS) + 2 * INDEX + 2 * LOGITS
    assert t.all_spaces == every
    # HBM alone: the slice's read, u's read in the copy, the update's write, the branch
    assert t.hbm == LAYER + ROWS + ROWS + 2 * INDEX + 2 * LOGITS
    assert t.on_chip == LAYER + ROWS + ROWS
    # the scoped branch not taken: the identity counts nothing
    assert t.all_spaces - t.plain_all_spaces == 2 * LOGITS
    assert t.hbm - t.plain_hbm == 2 * LOGITS
    assert traffic(MODULE).plain_hbm == t.hbm  # no scopes named: nothing skipped


def test_a_compiled_program_reads_its_arguments_from_hbm() -> None:
    """A small program compiled for a v5e chip with the server's options (memory-space assignment
    on): XLA's count less what lives outside HBM still holds its arguments' reads and its
    output's write, and no more than XLA's count."""
    pytest.importorskip("libtpu")
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=sharding)

    def fn(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w) @ w

    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # TPU programs cannot load here
    try:
        with jax.default_device(device):
            compiled = jax.jit(fn).lower(x, w).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    xla = compiled.cost_analysis()["bytes accessed"]
    t = traffic(compiled.as_text())
    least = (128 * 512 * 2) * 2 + 512 * 512 * 2  # x read, the output written, w once
    assert least <= xla - t.on_chip <= xla
