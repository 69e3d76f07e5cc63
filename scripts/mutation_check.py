"""Planted-bug check: does the test suite catch known bug patterns?

Each mutation below is a small, plausible bug (a wrong dimension, a dropped term, a flipped
sign, a check that validates and then forgets). For each one the script copies the working
tree to a temporary directory, plants the bug there by exact text replacement (the text
must occur exactly once, so a stale pattern reports ERROR instead of planting nothing), runs
the tests that should catch it, and reports CAUGHT (the tests failed), MISSED (they
passed) or ERROR (the text was not found, or the copy did not import or collect: not a
catch). ``--check-text`` checks only that every pattern's text is still there (seconds).

Run it before and after every kernel or op change: every pattern must stay CAUGHT.
It is not part of CI: each mutation runs a test selection through the Mosaic GPU
interpreter on CPU (minutes each).

    python scripts/mutation_check.py                 # every mutation
    python scripts/mutation_check.py --list
    python scripts/mutation_check.py --check-text     # only: does each old text occur once?
    python scripts/mutation_check.py --only lm_ignore_index_as_nonnegative,in_place_dropped
    python scripts/mutation_check.py --tests-from 7b0b9bd   # the suite as it was at a commit
    python scripts/mutation_check.py --markdown out.md      # also write the table

Adding a pattern: append a ``Mutation`` with the exact ``old`` text of the unmodified file,
the ``new`` text, and the pytest arguments of the tests that must catch it; run
``--only NAME`` and check it says CAUGHT (and MISSED with ``--tests-from`` an older suite,
if the pattern is a regression test for a blind spot).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
  name: str
  file: str  # relative to the repo root
  old: str  # exact text, occurring once in the unmodified file
  new: str
  tests: tuple[str, ...]  # pytest arguments that must catch it
  why: str = ""
  gpu_only: bool = False  # the bug shows only with compiled kernels (not the interpreter)


MUTATIONS = [
    # ---- blind spots an audit of the suite found (the old suite passed all but the r
    # term, which only its per-row check caught, at a 2x margin) ------------------------
    Mutation(
        "lm_ignore_index_as_nonnegative", "coda_jax/fused_ops.py",
        "  valid = ((targets != ignore_index)\n",
        "  valid = ((targets >= 0)\n",
        ("tests/test_losses.py", "-k", "ignore_0"),
        "loss_row_weights tests targets >= 0 instead of != ignore_index: with "
        "ignore_index=0 the hidden-state gradient is 52% wrong"),
    Mutation(
        "in_place_dropped", "pallas_kernels/gemm_mgpu.py",
        "  if config is None:\n    config = default_config(m, n, k, a.dtype, "
        "input_kinds=staged(in_place),",
        "  in_place = {}\n  if config is None:\n    config = default_config(m, n, k, a.dtype, "
        "input_kinds=staged(in_place),",
        ("tests/test_in_place.py",),
        "gemm validates in_place and then drops it: values right, buffer not reused"),
    Mutation(
        "residual_norm_bwd_uses_k_for_d", "coda_jax/fused_ops.py",
        "  d = x.shape[1]\n  dxt =", "  d = y.shape[1]\n  dxt =",
        ("tests/test_fused_ops.py",),
        "_residual_rmsnorm_bwd divides by the contraction size K instead of D"),
    Mutation(
        "residual_norm_bwd_drops_r_term", "coda_jax/fused_ops.py",
        "\n         - (dr * r ** 3 / d)[:, None] * xf)", ")",
        ("tests/test_fused_ops.py",),
        "the gradient through r, -(dr r^3 / D) x, is deleted"),
    # ---- fused ops and losses -----------------------------------------------------------
    Mutation(
        "lm_row_chunks_miscount", "coda_jax/block_gemms.py",
        "  fits = lambda rows: rows * v * 2 * buffers <= budget_bytes",
        "  fits = lambda rows: rows * v * 2 <= budget_bytes",
        ("tests/test_losses.py", "-k", "default_chunking or row_chunks_odd"),
        "the default LM-head chunking counts one (rows, V) buffer where the forward-formed "
        "gradient holds two (skipping the smallest 256-multiple, this pattern's earlier "
        "form, changes nothing since row_chunks falls back to multiples of 64)"),
    Mutation(
        "lm_bwd_drops_last_chunk", "coda_jax/fused_ops.py",
        "tuple(chunked(rows, h, r, lse, tgt, rest, targets, weight))",
        "tuple(chunked(rows, h, r, lse, tgt, rest, targets, weight.at[-rows:].set(0)))",
        ("tests/test_losses.py",),
        "the LM-head backward loses the last row chunk's gradient"),
    Mutation(
        "rope_bwd_sign", "coda_jax/block_gemms.py",
        '"pos": positions, "neg_freqs": -freqs}',
        '"pos": positions, "neg_freqs": freqs}',
        ("tests/test_fused_ops.py", "-k", "qkv_rope or rope_backward"),
        "RoPE backward rotates forward instead of back"),
    Mutation(
        "gelu_derivative", "coda_jax/primitives.py",
        "h + a * (1 - t * t) * (", "h + a * (1 - t) * (",
        ("tests/test_fused_ops.py", "-k", "geglu"),
        "GELU's derivative drops a tanh factor"),
    Mutation(
        "fp32_path_rounds_dz_to_bf16", "coda_jax/fused_ops.py",
        "(dzf * r[:, None]).astype(h.dtype)",
        "(dzf * r[:, None]).astype(jnp.bfloat16).astype(h.dtype)",
        ("tests/test_fused_ops.py", "-k", "float32_activations"),
        "float32 activations silently pass through bf16"),
    Mutation(
        "r_from_stored_x", "coda_jax/block_gemms.py",
        '  r = jax.lax.rsqrt(out["ss"] / w.shape[1] + eps)',
        '  r = jax.lax.rsqrt(jnp.mean(jnp.square(out["x"].astype(jnp.float32)), axis=1) + eps)',
        ("tests/test_fused_ops.py", "-k", "fp16_residual"),
        "RMSNorm statistics taken from the stored fp16 x (inf past 65504), not the fp32 tile"),
    Mutation(
        "acc_fp16_before_row_scale", "coda_jax/primitives.py",
        "    return x * env.load(self.name).astype(jnp.float32)[:, None]",
        "    return x.astype(jnp.float16).astype(jnp.float32) * "
        "env.load(self.name).astype(jnp.float32)[:, None]",
        ("tests/test_fused_ops.py", "-k", "fp16_swiglu"),
        "the fp32 accumulator is rounded to fp16 before the row scale (overflows)"),
    Mutation(
        "head_checks_removed", "coda_jax/fused_ops.py",
        "  check_heads(n_q_heads, n_kv_heads, head_dim)  # before wqkv, whose shape they define\n",
        "", ("tests/test_fused_ops.py", "-k", "bad_inputs"),
        "rmsnorm_qkv_rope no longer checks head_dim and the head counts"),
    # ---- blocks, layers and training -----------------------------------------------------
    Mutation(
        "mlp_bwd_d_is_attn_width", "coda_jax/blocks.py",
        "  d = x1.shape[1]\n", "  d = y0.shape[1]\n",
        ("tests/test_blocks.py", "-k", "forward_and_grads"),
        "the block's MLP backward divides the zdz term by Hq*hd instead of D"),
    Mutation(
        "shifted_bwd_drops_c2", "coda_jax/blocks.py",
        'x2, r2, c2, p["g_attn"], dx2', 'x2, r2, 0 * c2, p["g_attn"], dx2',
        ("tests/test_blocks.py", "-k", "forward_and_grads"),
        "the gradient through the next layer's norm statistics r2 is dropped"),
    Mutation(
        "mlp_bwd_silu_for_gelu", "coda_jax/blocks.py",
        "z, cfg.swiglu_block, cfg.activation,\n", 'z, cfg.swiglu_block, "silu",\n',
        ("tests/test_blocks.py", "-k", "gelu"),
        "the block backward differentiates SiLU whatever the activation"),
    Mutation(
        "norm_stats_r_no_grad", "flax_layers/layers.py",
        "  return h, unfused.rms_scale(x, eps)",
        "  return h, unfused.rms_scale(jax.lax.stop_gradient(x), eps)",
        ("tests/test_flax_layers.py", "-k", "llama_block"),
        "the layers' RMSNorm passes no gradient through r (both paths share it)"),
    Mutation(
        "optimizer_decays_norms", "flax_layers/train.py",
        'lambda path, _: not any(w in str(getattr(k, "key", k)) for k in path\n'
        '                              for w in ("norm", "bias")), params)',
        "lambda path, _: True, params)",
        ("tests/test_flax_layers.py", "-k", "optimizer or weight_decay"),
        "AdamW's weight decay reaches the norm weights and biases"),
    # ---- primitives against independent formulas, through the kernel ---------------------
    Mutation(
        "silu_sigmoid_scaled", "coda_jax/primitives.py",
        '"silu": (lambda a: a * jax.nn.sigmoid(a), _silu_and_grad),',
        '"silu": (lambda a: a * jax.nn.sigmoid(1.01 * a), _silu_and_grad),',
        ("tests/test_primitives.py", "-k", "independent_formula"),
        "SiLU 1% off (same code in kernel and reference, so only an independent oracle sees it)"),
    Mutation(
        "gated_swaps_gate_and_up", "coda_jax/primitives.py",
        "return _join([act(a) * b for a, b in _blocks(x, self.block)])",
        "return _join([act(b) * a for a, b in _blocks(x, self.block)])",
        ("tests/test_primitives.py", "-k", "independent_formula"), "gate and up swapped"),
    Mutation(
        "gelu_erf_for_tanh", "coda_jax/primitives.py",
        '"gelu": (lambda a: jax.nn.gelu(a, approximate=True), _gelu_tanh_and_grad),',
        '"gelu": (lambda a: jax.nn.gelu(a, approximate=False), _gelu_tanh_and_grad),',
        ("tests/test_primitives.py", "-k", "independent_formula"),
        "GELU's erf form where the tanh form is documented (2e-4 apart)"),
    Mutation(
        "rotate_transposed", "coda_jax/primitives.py",
        "out += [a * c - b * s, b * c + a * s]", "out += [a * c + b * s, b * c - a * s]",
        ("tests/test_primitives.py", "-k", "independent_formula"),
        "RoPE rotates the wrong way in kernel and reference alike"),
    Mutation(
        "lse_combination", "coda_jax/primitives.py",
        "jnp.sum(sumexp_partials * jnp.exp(max_partials - mx), axis=0)",
        "jnp.sum(sumexp_partials * jnp.exp(mx - max_partials), axis=0)",
        ("tests/test_primitives.py", "-k", "independent_formula"),
        "log-sum-exp partials rescaled the wrong way"),
    Mutation(
        "scale_row_as_column", "coda_jax/primitives.py",
        "return x * env.load(self.name).astype(jnp.float32)[:, None]",
        "return x * env.load(self.name).astype(jnp.float32)[None, :]",
        ("tests/test_primitives.py", "-k", "independent_formula"),
        "a row scale applied along columns"),
    Mutation(
        "colsum_of_squares", "coda_jax/primitives.py",
        "env.store_column_sum(self.name, x)", "env.store_column_sum(self.name, x * x)",
        ("tests/test_primitives.py", "-k", "independent_formula"), "ColSum sums squares"),
    Mutation(
        "pick_column_off_by_one", "coda_jax/primitives.py",
        "hit = env.column_ids() == env.load(self.index)[:, None]",
        "hit = env.column_ids() == env.load(self.index)[:, None] + 1",
        ("tests/test_primitives.py", "-k", "independent_formula"),
        "the target logit is picked one column off"),
    # ---- backward primitives through the kernel against autodiff -------------------------
    Mutation(
        "rmsnorm_grad_formula", "coda_jax/grad_primitives.py",
        "return r * (g * dn - xhat * c)", "return r * (g * dn + xhat * c)",
        ("tests/test_grad_primitives.py",), "RMSNorm backward: wrong sign of the zdz term"),
    Mutation(
        "rmsnorm_grad_row_scaled_r_once", "coda_jax/grad_primitives.py",
        "rrc = (r * r * env.load(self.c)", "rrc = (r * env.load(self.c)",
        ("tests/test_grad_primitives.py", "-k", "row_scaled"),
        "the row-scaled RMSNorm backward's zdz term takes r once, not r^2"),
    Mutation(
        "weight_grad_row_scale_dropped", "coda_jax/block_gemms.py",
        'scale, operands = [P.ScaleRow("g")], {"g": row_scale.astype(jnp.float32)}',
        "scale, operands = [], {}",
        ("tests/test_blocks.py", "-k", "test_blocks_forward_and_grads and bf16-silu"),
        "dW = diag(g) x^T (r dz) forgets g: the QKV and gate-up weight gradients"),
    Mutation(
        "gated_grad_not_row_scaled", "coda_jax/blocks.py",
        "cfg.impl, r=r1, store_y=kept_y is None)",
        "cfg.impl, store_y=kept_y is None)",
        ("tests/test_blocks.py", "-k", "test_blocks_forward_and_grads and bf16-silu"),
        "the SwiGLU backward stores dz unscaled, which the row-scaled norm backward reads"),
    Mutation(
        "mlp_output_not_kept", "coda_jax/blocks.py",
        'fenced(x1, y1 if cfg.mlp_residuals == "output" else None)',
        "fenced(x1, None)",
        ("tests/test_blocks.py", "-k", "mlp_residuals"),
        "BlockConfig.mlp_residuals='output' keeps nothing: the backward recomputes y"),
    Mutation(
        "list_hides_timed_count", "bench/tune_gemm.py",
        '      return f"tuned, {timed} configs timed"',
        '      return "tuned"',
        ("tests/test_bench_harness.py", "-k", "how_many_configs"),
        "tune_gemm --list no longer says how narrow an entry's search was"),
    Mutation(
        "sustained_without_warmup", "bench/common.py",
        "  if names and warmup_s > 0:",
        "  if False:",
        ("tests/test_bench_harness.py", "-k", "sustained_windows"),
        "compare_configs' sustained windows start from the idle clock: the first config "
        "timed pays the climb (up to 2x on the H200)"),
    Mutation(
        "block_timer_without_warmup", "bench/block.py",
        "sustained_s, 1,\n                                             power=log)",
        "sustained_s, 1,\n                                             power=log, warmup_s=0)",
        ("tests/test_bench_harness.py", "-k", "block_timer_sustained"),
        "the block benchmarks' sustained window starts from the idle clock after the compile"),
    Mutation(
        "kernel_key_reads_tuned_configs", "pallas_kernels/kernel_cache.py",
        'return source_digest(_PACKAGE, suffixes=(".py",))',
        "return source_digest(_PACKAGE)",
        ("tests/test_kernel_cache.py", "-k", "digest"),
        "the kernel key digests the tuned configs' file: every retune re-lowers every kernel"),
    Mutation(
        "swiglu_dz_over_z", "coda_jax/block_gemms.py",
        'P.Store("dz", dt)], operands, trans_b=True, impl=impl)',
        'P.Store("dz", dt)], operands, trans_b=True, impl=impl,\n                      in_place={"dz": "z"})',
        ("tests/test_bench_harness.py", "-k", "train_steps_gemms"),
        "the SwiGLU backward writes dz over z: in the layer scan XLA copies z's slice out first"),
    Mutation(
        "residuals_not_fenced", "coda_jax/blocks.py",
        'saved_x1, kept_y = fenced(x1, y1 if cfg.mlp_residuals == "output" else None)',
        'saved_x1, kept_y = (x1, y1 if cfg.mlp_residuals == "output" else None)',
        ("tests/test_blocks.py", "-k", "fences_shared_residuals"),
        "x1 and y1 stored unfenced: in a layer scan XLA's dynamic-slice fusion runs the "
        "out-projection and gate-up GEMMs twice"),
    Mutation(
        "slope_residual_not_fenced", "coda_jax/layernorm_ops.py",
        'fenced(first[nm])[0] if nm == "a" else first[nm]',
        "first[nm]",
        ("tests/test_residual_fences.py", "-k", "slope"),
        "GPT-2's MLP keeps a (read by its output GEMM too) unfenced: in a layer scan XLA "
        "runs the first GEMM twice"),
    Mutation(
        "gated_grad_stores_y_anyway", "coda_jax/grad_primitives.py",
        "    if self.y is None:\n      return (zdz,)\n",
        "",
        ("tests/test_grad_primitives.py", "-k", "no_y"),
        "GatedGrad(y=None) still declares a y output"),
    Mutation(
        "same_shape_takes_any_chip", "bench/tune_gemm.py",
        "if other.device_kind not in kinds or other.signature == key.signature:",
        "if other.signature == key.signature:",
        ("tests/test_bench_harness.py", "-k", "same_shape"),
        "--same-shape times configs tuned on another chip"),
    Mutation(
        "gated_grad_zdz_drops_b", "coda_jax/grad_primitives.py",
        "zdz = zdz + jnp.sum(a * da + b * db, axis=1)",
        "zdz = zdz + jnp.sum(a * da, axis=1)",
        ("tests/test_grad_primitives.py", "-k", "autodiff"),
        "the zdz row term of the gated backward misses the up half"),
    Mutation(
        "rmsnorm_grad_n_drops_g", "coda_jax/grad_primitives.py",
        "env.store(self.n, xhat * g)", "env.store(self.n, xhat)",
        ("tests/test_grad_primitives.py", "-k", "autodiff"),
        "the recomputed n = r x g (dW's A operand) forgets g"),
    Mutation(
        "xent_grad_zdz_wrong", "coda_jax/grad_primitives.py",
        "env.store(self.zdz, jnp.sum(d * x, axis=1))",
        "env.store(self.zdz, jnp.sum(d * x * x, axis=1))",
        ("tests/test_grad_primitives.py", "-k", "autodiff"),
        "the cross-entropy backward's zdz term is wrong"),
    # ---- kernel errors -------------------------------------------------------------------
    Mutation(
        "pairwise_after_narrowing_unchecked", "coda_jax/epilogue_gemm.py",
        "if width != 1 and (prim.column_group() is not None or prim.width_factor() != 1):",
        "if False:", ("tests/test_errors.py", "-k", "pairwise_after_narrowing"),
        "a pairwise step after a width change is no longer rejected"),
    Mutation(
        "split_b_unchecked", "pallas_kernels/gemm_mgpu.py",
        "  if _split_b_too_narrow(config, trans_b):", "  if False:",
        ("tests/test_errors.py", "-k", "split_b_too_narrow"),
        "a warpgroup half of B narrower than its 64-column swizzle is not rejected"),
    Mutation(
        "output_width_multiple_of_4", "pallas_kernels/gemm_mgpu.py",
        "and o.subtile_shape(config.epi_tile_m, config.epi_tile_n)[-1] % 8):",
        "and o.subtile_shape(config.epi_tile_m, config.epi_tile_n)[-1] % 4):",
        ("tests/test_errors.py", "-k", "output_width_not_multiple_of_8"),
        "an output sub-tile width that is not a multiple of 8 gets through"),
    # ---- GPU only: the interpreter does not reproduce XLA's GPU fusion -------------------
    Mutation(
        "in_place_without_barriers", "pallas_kernels/gemm_mgpu.py",
        "    backing = {nm: jax.new_ref(lax.optimization_barrier(ops[nm]))\n"
        "               for nm in in_place.values()}\n"
        "    kernel = make_kernel(in_place, smem_used)\n"
        "    results = iter(kernel(*args[:len(lead)], *(backing.get(nm, ops[nm]) for nm in names_in)))\n"
        "    return tuple(lax.optimization_barrier(jax.freeze(backing[in_place[nm]]))\n",
        "    backing = {nm: jax.new_ref(ops[nm]) for nm in in_place.values()}\n"
        "    kernel = make_kernel(in_place, smem_used)\n"
        "    results = iter(kernel(*args[:len(lead)], *(backing.get(nm, ops[nm]) for nm in names_in)))\n"
        "    return tuple(jax.freeze(backing[in_place[nm]])\n",
        ("tests/test_in_place.py", "-k", "over_slices or custom_vjp"),
        "without the barriers XLA's GPU dynamic-slice fusion ignores the kernel's aliasing "
        "(NaN gradients in a layer scan; docs/design.md#6-in-place-outputs-and-xla)",
        gpu_only=True),
    # ---- the ping-pong schedule and the staged tile operands ---------------------------
    Mutation(
        "pingpong_producer_skips_release_wait", "pallas_kernels/gemm_mgpu.py",
        "          @pl.when(step >= stages)\n          def _wait_released():",
        "          @pl.when(step < 0)  # (planted) never waits\n          def _wait_released():",
        ("tests/test_gemm_mainloop.py", "-k", "race_free and pingpong"),
        why="the ring's next TMA must not land in a slot a wgmma still reads"),
    Mutation(
        "pingpong_epilogues_do_not_take_turns", "pallas_kernels/gemm_mgpu.py",
        "    def _wait_for_previous():\n      with _wait_scope(\"wait_turn\"):\n"
        "        plgpu.barrier_wait(turn.at[1 - self.wg])",
        "    def _wait_for_previous():\n      with _wait_scope(\"wait_turn\"):\n"
        "        pass",
        ("tests/test_primitives.py", "-k", "race_free and pingpong and colsum"),
        why="column partials share one scratch buffer: the two epilogues must not overlap"),
    Mutation(
        "operand_slot_ignores_slot_count", "pallas_kernels/gemm_mgpu.py",
        "      slot, in_slot = s % self.out_slots, q % self.in_slots",
        "      slot, in_slot = s % self.out_slots, q % 2",
        ("tests/test_primitives.py", "-k", "tile_operand_slots"),
        why="with 3 or 8 slots the epilogue would read another sub-tile's residual"),
    Mutation(
        "tile_operand_refetched_before_read", "pallas_kernels/gemm_mgpu.py",
        "      tile = self._tile(slot, in_slot, i, j, r0, c0, read, first_pass=first_pass,\n",
        "      if refill and read is None:  # (planted)\n"
        "        refill()\n"
        "        refill = None\n"
        "      tile = self._tile(slot, in_slot, i, j, r0, c0, read, first_pass=first_pass,\n",
        ("tests/test_primitives.py", "-k", "tile_operand_slots"),
        why="a slot is refilled only once every warp has read it (with one slot, each "
            "sub-tile's load waits for the previous sub-tile's read)"),
    Mutation(
        "split_store_reuses_one_slot", "pallas_kernels/gemm_mgpu.py",
        "      buf = ring.at[self.wg, h % _PART_SLOTS]\n",
        "      buf = ring.at[self.wg, 0]\n",
        ("tests/test_primitives.py", "-k", "stores_in_parts"),
        why="a part staged in the slot the previous part's store may still be reading"),
    Mutation(
        "part_ring_outputs_start_apart", "pallas_kernels/gemm_mgpu.py",
        "      buf = ring.at[self.wg, h % _PART_SLOTS]\n",
        "      buf = ring.at[self.wg, (h + list(self.rings).index(o.name)) % _PART_SLOTS]\n",
        ("tests/test_primitives.py", "-k", "stores_in_parts"),
        why="outputs sharing a ring each start at slot 0: a second output starting at "
            "slot 1 takes the slot the previous store, still in flight, reads"),
    Mutation(
        "part_rings_one_per_output", "pallas_kernels/gemm_mgpu.py",
        "      rings[o.name] = f\"parts_{jnp.dtype(o.dtype).name}_{'x'.join(map(str, shape))}\"\n",
        "      rings[o.name] = f\"parts_{o.name}_{'x'.join(map(str, shape))}\"\n",
        ("tests/test_autotune.py", "-k", "share_one_ring"),
        why="outputs whose parts have one dtype and shape share a ring: two slots each "
            "cost Qwen3's QKV projection a pipeline stage"),
    Mutation(
        "split_store_waits_too_little", "pallas_kernels/gemm_mgpu.py",
        "      plgpu.wait_smem_to_gmem(_PART_SLOTS - 1, wait_read_only=True)\n      buf =",
        "      plgpu.wait_smem_to_gmem(_PART_SLOTS, wait_read_only=True)\n      buf =",
        ("tests/test_primitives.py", "-k", "stores_in_parts"),
        why="with two slots a part may reuse its slot only once at most one store is "
            "in flight"),
    Mutation(
        "early_refetch_before_read", "pallas_kernels/gemm_mgpu.py",
        "        read = {nm: self.smem[\"i_\" + nm].at[self.wg, in_slot][...] for nm in staged}\n"
        "        if refill:\n"
        "          plgpu.commit_smem()  # ends with a warpgroup barrier: every warp has read\n"
        "          refill()\n",
        "        if refill:  # (planted)\n"
        "          plgpu.commit_smem()\n"
        "          refill()\n"
        "        read = {nm: self.smem[\"i_\" + nm].at[self.wg, in_slot][...] for nm in staged}\n",
        ("tests/test_primitives.py", "-k", "tile_operand_slots"),
        why="an early refill may start only once the sub-tile's operands are in registers"),
    Mutation(
        "output_slot_wait_off_by_one", "pallas_kernels/gemm_mgpu.py",
        "plgpu.wait_smem_to_gmem(0 if s == 0 else self.out_slots - 1, wait_read_only=True)",
        "plgpu.wait_smem_to_gmem(0 if s == 0 else self.out_slots, wait_read_only=True)",
        ("tests/test_primitives.py", "-k", "output_slots"),
        why="a sub-tile may write its output slot only once the store that last read it "
            "is done: at most epi_out_slots - 1 groups in flight"),
    Mutation(
        "split_store_every_part_at_column_zero", "pallas_kernels/gemm_mgpu.py",
        "      plgpu.copy_smem_to_gmem(buf, self._window(o, r0, c0, part=h),\n",
        "      plgpu.copy_smem_to_gmem(buf, self._window(o, r0, c0),\n",
        ("tests/test_primitives.py", "-k", "stores_in_parts"),
        why="every part stored over the sub-tile's first columns: the rest unwritten"),
    Mutation(
        "pingpong_epilogue_at_wrong_tile", "pallas_kernels/gemm_mgpu.py",
        "        t = 2 * i + wg\n        mi, ni = _tile_origin(cluster_id + t * num_clusters,",
        "        t = 2 * i + wg\n        mi, ni = _tile_origin(cluster_id + (t ^ 1) * num_clusters,",
        ("tests/test_gemm_mainloop.py", "-k", "configs and pingpong"),
        why="each warpgroup must store the tile whose stages it consumed"),
    # ---- K = 0: the epilogue pass with no mainloop (_kernel_no_product) -----------------
    Mutation(
        "no_product_both_warpgroups_on_one_half", "pallas_kernels/gemm_mgpu.py",
        "    return mi, ni, mi * cm + wg * cfg.tile_m, ni * cn\n",
        "    return mi, ni, mi * cm, ni * cn\n",
        ("tests/test_primitives.py", "-k", "no_product"),
        why="both warpgroups run the CTA tile's first half: the second is never written"),
    Mutation(
        "no_product_smem_counts_a_ring", "pallas_kernels/gemm_mgpu.py",
        "config.tile_k * jnp.dtype(dtype).itemsize * mainloop\n",
        "config.tile_k * jnp.dtype(dtype).itemsize\n",
        ("tests/test_autotune.py", "-k", "no_product"),
        why="a K = 0 pass is sized as if it had a pipeline ring: its heuristic config "
            "shrinks for shared memory it never allocates"),
    Mutation(
        "column_sum_turn_not_waited", "pallas_kernels/gemm_mgpu.py",
        "    plgpu.barrier_wait(turn.at[1 - self.wg])\n    total = jnp.sum(x, axis=0)\n",
        "    total = jnp.sum(x, axis=0)\n",
        ("tests/test_primitives.py", "-k", "colsum"),
        why="a warpgroup sums its columns without waiting for the other's turn: both "
            "use the same shared scratch"),
    Mutation(
        "column_sums_via_env_ignored", "coda_jax/dispatch.py",
        "                column_sum_turns=all(p.column_sums_via_env() for p in call.program),\n",
        "                column_sum_turns=True,\n",
        ("tests/test_primitives.py", "-k", "every_step_says_so"),
        why="a program with a step that sums rows itself (not through env.column_sum) "
            "gets per-sum turns: its own sums race for the shared scratch on the GPU"),
    # ---- the per-shard rule (coda_jax/partitioning.py) -----------------------------------
    Mutation(
        "shard_lse_summed", "coda_jax/partitioning.py",
        "        out[name] = mx + jnp.log(jax.lax.psum(jnp.exp(out[name] - mx), axes))",
        "        out[name] = jax.lax.psum(out[name], axes)",
        ("tests/test_sharding.py",),
        "log-sum-exps of vocabulary shards added instead of combined"),
    Mutation(
        "shard_targets_not_shifted", "coda_jax/partitioning.py",
        "      operands[nm] = operands[nm] - offset.astype(operands[nm].dtype)",
        "      operands[nm] = operands[nm]",
        ("tests/test_sharding.py",),
        "on a column shard the targets index local columns as if they were global"),
    Mutation(
        "shard_targets_shifted_per_step", "coda_jax/partitioning.py",
        "    for nm in dict.fromkeys(nm for prim in call.program\n"
        "                            for nm in prim.column_index_operands()):\n",
        "    for nm in [nm for prim in call.program for nm in prim.column_index_operands()]:\n",
        ("tests/test_sharding.py",),
        "the targets, shared by RowLogSumExp(exclude=) and PickColumn, shifted to the "
        "shard's columns once per step that reads them (landed in b3680bb, caught by CI)"),
    Mutation(
        "shard_partials_over_wrong_axes", "coda_jax/partitioning.py",
        '      axes = layout.m if kinds[name][0] == "col" else layout.n',
        '      axes = layout.n if kinds[name][0] == "col" else layout.m',
        ("tests/test_sharding.py",),
        "row partials summed over the row shards, column partials over the column shards"),
    Mutation(
        "shard_contraction_not_summed", "coda_jax/partitioning.py",
        "    acc = jax.lax.psum(acc, layout.k)\n", "",
        ("tests/test_sharding.py",),
        "a split contraction's partial products are not summed before the epilogue"),
    Mutation(
        "shard_contraction_not_summed_vs_truth", "coda_jax/partitioning.py",
        "    acc = jax.lax.psum(acc, layout.k)\n", "",
        ("tests/test_sharding.py", "-k", "as_accurate_as_one_device"),
        "the same bug, for the blocks' check against float32, which alone holds the "
        "tensor-parallel blocks on the GPU (their difference from one device is ~4e-3 "
        "there)"),
    # ---- the tuning cache's name of a program (coda_jax/primitives.py) -------------------
    Mutation(
        "program_id_dtype_as_passed", "coda_jax/primitives.py",
        "           for v in [getattr(prim, f.name)] if v is not None}\n",
        "           for v in [getattr(prim, f.name)] if False}\n",
        ("tests/test_primitives.py", "-k", "program_id"),
        "a program's cache name spells a dtype as passed: Store(y, jnp.bfloat16) misses the "
        "config tuned for Store(y, x.dtype) and runs the heuristic (16% slower for GPT-2's "
        "LayerNorm pass)"),
    # ---- the shard_map train step and jax 0.11.2's cuDNN-attention crash -----------------
    Mutation(
        "shard_map_step_skips_attention_check", "flax_layers/train.py",
        "      check_shard_map_attention(model.config)\n", "",
        ("tests/test_sharding.py", "-k", "checks_attention_before_compiling"),
        "the shard_map train step no longer refuses cuDNN attention: on a GPU the process "
        "dies in XLA's compiler instead of raising"),
    Mutation(
        "shard_map_attention_check_ignores_default", "flax_layers/train.py",
        "  attention = Lyr.attention_impl(config.dtype, config.attention_impl, platform=platform)\n",
        "  attention = config.attention_impl\n",
        ("tests/test_sharding.py", "-k", "refuses_cudnn"),
        "the check reads only an attention named in the config, missing cuDNN chosen by "
        "default on a GPU"),
    # ---- RoPE scaling, bad targets, training state --------------------------------------
    Mutation(
        "rope_scaling_blend_inverted", "coda_jax/layout.py",
        "    return f * ((1 - s) / self.factor + s)",
        "    return f * (s / self.factor + (1 - s))",
        ("tests/test_rope_scaling.py",),
        "llama3 scaling divides the fast rotations instead of the slow ones"),
    Mutation(
        "bad_targets_not_nan", "coda_jax/fused_ops.py",
        "  losses = jnp.where(out_of_range(targets, vocab, ignore_index), jnp.nan, losses)\n",
        "",
        ("tests/test_losses.py", "-k", "out_of_range"),
        "the fused loss gives a finite number for a target outside the vocabulary"),
    Mutation(
        "resume_ignores_checkpoint", "bench/train.py",
        "    state = mngr.restore(start, args=ocp.args.StandardRestore(abstract))\n",
        "    mngr.restore(start, args=ocp.args.StandardRestore(abstract))\n",
        ("tests/test_main_job_resume.py", "-k", "bit_for_bit"),
        "--resume restores the checkpoint but trains on from the fresh initialization"),
    Mutation(
        "padding_ignores_zero_rows_rule", "coda_jax/dispatch.py",
        "  return not has_cols or all(p.keeps_zero_rows() for p in call.program)",
        "  return True",
        ("tests/test_dispatch.py",),
        "rows padded under a step that moves a zero row: its column sums count the padding"),
    Mutation(
        "padding_not_sliced", "coda_jax/dispatch.py",
        '    out = {nm: v if kinds.get(nm, ("tile",))[0] == "col" else v[:m] for nm, v in out.items()}',
        "    out = dict(out)",
        ("tests/test_dispatch.py",),
        "the padded rows reach the caller"),
    # ---- 3-GEMM LM head, tied head, ragged batches ---------------------------------------
    Mutation(
        "lm_unit_grads_not_scaled", "coda_jax/fused_ops.py",
        "    dh, dr, dw = scale_grads((dh, dr, dw), dloss * norm)\n",
        "",
        ("tests/test_losses.py", "-k", "loss_and_grads"),
        "the forward's unit-cotangent gradients are returned without the real cotangent"),
    Mutation(
        "lm_unit_weights_ignore_mean", "coda_jax/fused_ops.py",
        "    return weight, 1.0 / jnp.maximum(jnp.sum(targets != ignore_index), 1)",
        "    return weight, 1.0 + 0 * jnp.maximum(jnp.sum(targets != ignore_index), 1)",
        ("tests/test_losses.py", "-k", "loss_and_grads"),
        "the forward-formed gradient of a mean loss misses the 1 / count"),
    Mutation(
        "post_block_zdz_dropped", "coda_jax/blocks.py",
        "    dxa, n2, dg = S.norm_input_grad(dlogits, wlm, x2c, r2c, zdz / d, p[\"g_final\"], None,",
        "    dxa, n2, dg = S.norm_input_grad(dlogits, wlm, x2c, r2c, 0 * zdz, p[\"g_final\"], None,",
        ("tests/test_blocks.py", "-k", "scalar_loss"),
        "the final norm's backward loses its <dlogits, logits> term on the 3-GEMM path"),
    Mutation(
        "ragged_padding_targets_counted", "flax_layers/model.py",
        "jnp.pad(targets, pad, constant_values=self.head.ignore_index)",
        "jnp.pad(targets, pad)",
        ("tests/test_flax_layers.py", "-k", "ragged"),
        "padded tokens of a ragged batch count in the loss"),
    # ---- LayerNorm, column bias, GPT-2's GELU MLP (coda_jax/layernorm_ops.py) ------------
    Mutation(
        "ln_producer_bwd_drops_mean_term", "coda_jax/layernorm_ops.py",
        "    return acc + dh * g + a - b * (x - mu)\n",
        "    return acc + dh * g - b * (x - mu)\n",
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and residual_layernorm"),
        "residual_layernorm's backward loses the mean path dmu / D"),
    Mutation(
        "ln_grad_dmu_dropped", "coda_jax/layernorm_ops.py",
        "env.store(self.dmu, -r * jnp.sum(dn * g, axis=1))",
        "env.store(self.dmu, 0 * r)",
        ("tests/test_layernorm_ops.py", "-k", "layernorm_grad_matches_autodiff or "
         "(op_and_grads_xla and composed)"),
        "LayerNormGrad emits no cotangent for mu: the consumer's mean term has no gradient"),
    Mutation(
        "ln_bias_grad_from_dx_only", "coda_jax/layernorm_ops.py",
        'out = epilogue_pass([AddTile("dx"), LayerNormInputGrad("dh", "x", "g", "mu", "a", "b"),\n'
        '                       ColSum("dsum"), Store("dxt", x.dtype)],',
        'out = epilogue_pass([AddTile("dx"), ColSum("dsum"),\n'
        '                       LayerNormInputGrad("dh", "x", "g", "mu", "a", "b"),\n'
        '                       Store("dxt", x.dtype)],',
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and residual_layernorm"),
        "the producer's bias gradient sums the pass-through cotangent dx, not the whole dx~"),
    Mutation(
        "ln_mlp_db1_before_gelu_grad", "coda_jax/layernorm_ops.py",
        'gemm_epilogue(dout, w2.astype(dt), [slope, ColSum("db1"), Store("dz", dt)]',
        'gemm_epilogue(dout, w2.astype(dt), [ColSum("db1"), slope, Store("dz", dt)]',
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and layernorm_gelu_mlp"),
        "b1's gradient summed from da, before the GELU derivative, instead of from dz "
        "(summing db2 over the wrong axis is no test of the suite: jax's custom_vjp shape "
        "check refuses it)"),
    Mutation(
        "gelu_grad_uses_silu_derivative", "coda_jax/layernorm_ops.py",
        'f, df = ACTIVATIONS["gelu"][1](env.load(self.z).astype(_F32))',
        'f, df = ACTIVATIONS["silu"][1](env.load(self.z).astype(_F32))',
        ("tests/test_layernorm_ops.py", "-k", "gelu_is_gpt2s_tanh_form"),
        "GeluGrad differentiates (and recomputes) SiLU, copied from the SwiGLU backward"),
    Mutation(
        "gelu_tanh_derivative_constant", "coda_jax/primitives.py",
        "(0.5 * k + (1.5 * k * _GELU_CUBIC) * a2)",
        "(0.5 * k + (0.5 * k * _GELU_CUBIC) * a2)",
        ("tests/test_layernorm_ops.py", "-k", "gelu_is_gpt2s_tanh_form"),
        "GELU's derivative forgets the 3 of d(a^3)/da"),
    Mutation(
        "ln_stats_eps_outside_rsqrt", "coda_jax/layernorm_ops.py",
        "return mu, jax.lax.rsqrt(var + eps)",
        "return mu, jax.lax.rsqrt(var) + eps",
        ("tests/test_layernorm_ops.py", "-k", "stats_with_mean_offset"),
        "LayerNorm's eps added to r instead of to the variance"),
    Mutation(
        "ln_stats_eps_dropped", "coda_jax/layernorm_ops.py",
        "return mu, jax.lax.rsqrt(var + eps)",
        "return mu, jax.lax.rsqrt(var)",
        ("tests/test_layernorm_ops.py", "-k", "stats_with_mean_offset"),
        "LayerNorm's statistics ignore eps"),
    Mutation(
        "ln_matmul_bias_not_added", "coda_jax/layernorm_ops.py",
        "gw, cw = norm_columns(g, beta, wd, bias)",
        "gw, cw = norm_columns(g, beta, wd)",
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and layernorm_matmul"),
        "layernorm_matmul validates its bias and then never adds it"),
    Mutation(
        "ln_mlp_residual_dropped", "coda_jax/layernorm_ops.py",
        '    out = gemm_epilogue(first["a"], w2.astype(dt), [AddBias("b2"), AddTile("x"),\n'
        '                                                     Store("out", dt)],\n'
        '                        {"b2": b2.astype(_F32), "x": x}, impl=impl)["out"]',
        '    out = gemm_epilogue(first["a"], w2.astype(dt), [AddBias("b2"), Store("out", dt)],\n'
        '                        {"b2": b2.astype(_F32)}, impl=impl)["out"]',
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and layernorm_gelu_mlp"),
        "layernorm_gelu_mlp returns the MLP's update without the residual stream"),
    Mutation(
        "ln_mean_term_sign", "coda_jax/layernorm_ops.py",
        'return [ScaleRow("r"), AddOuter("r_mu", "gw", -1.0), AddBias("cw"), *tail]',
        'return [ScaleRow("r"), AddOuter("r_mu", "gw", 1.0), AddBias("cw"), *tail]',
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and layernorm_matmul"),
        "the consumer adds (r mu) (x) gW instead of subtracting it"),
    # ---- QK-norm (coda_jax/qk_norm.py) ---------------------------------------------------
    Mutation(
        "qk_norm_over_whole_tile", "coda_jax/qk_norm.py",
        "rstd = _inv_rms(xb, self.eps)",
        "rstd = _inv_rms(x, self.eps)",
        ("tests/test_qk_norm.py", "-k", "forward_against_float64 or op_and_grads_kernel"),
        "HeadRmsNorm's mean runs over the whole sub-tile, not the head's head_dim columns "
        "(the XLA program runs one head per block since 063c375, so only a kernel sub-tile "
        "holding two heads shows it)"),
    Mutation(
        # was qk_norm_grad_projection_wrong_width (<dn, n> over the value's width): since
        # the per-head math moved into _normed_head, which sees one head, that text only
        # raised a NameError
        "qk_norm_grad_every_head_reads_first_u", "coda_jax/qk_norm.py",
        "self._head(env, i, u[:, i:i + d], dy[:, i:i + d], w[None, i:i + d])",
        "self._head(env, i, u[:, :d], dy[:, i:i + d], w[None, i:i + d])",
        ("tests/test_qk_norm.py", "-k", "op_and_grads_kernel"),
        "every head of a sub-tile takes the first head's saved u (the XLA program runs one "
        "head per block, so only a kernel sub-tile holding two heads shows it)"),
    Mutation(
        "qk_norm_grad_normalises_v_heads", "coda_jax/qk_norm.py",
        "self._passed_head, ub, dyb, wb)", "self._normed_head, ub, dyb, wb)",
        ("tests/test_qk_norm.py", "-k", "backward_pass and default"),
        "the backward treats the pass-through v heads as normalised"),
    Mutation(
        "column_value_at_sub_tile_start", "pallas_kernels/gemm_mgpu.py",
        'return lambda col: smem["i_" + nm][wg, vslot, j * en + col]',
        'return lambda col: smem["i_" + nm][wg, vslot, j * en]',
        ("tests/test_primitives.py", "-k", "no_product and head_norm_grad"),
        "tile.column_value reads every head's flag at the sub-tile's first column"),
    Mutation(
        "column_value_of_first_sub_tile", "pallas_kernels/gemm_mgpu.py",
        'return lambda col: smem["i_" + nm][wg, vslot, j * en + col]',
        'return lambda col: smem["i_" + nm][wg, vslot, col]',
        ("tests/test_primitives.py", "-k", "no_product and head_norm_grad"),
        "tile.column_value reads the warpgroup tile's first sub-tile for every sub-tile"),
    Mutation(
        "xla_block_column_ids_local", "coda_jax/dispatch.py",
        "    return jax.lax.broadcasted_iota(jnp.int32, self.shape, 1) + self.col0\n",
        "    return jax.lax.broadcasted_iota(jnp.int32, self.shape, 1)\n",
        ("tests/test_dispatch.py", "-k", "column_groups_per_block"),
        "the XLA program's column blocks see their own columns as 0.., not global ids"),
    Mutation(
        "xla_block_row_partials_summed", "coda_jax/dispatch.py",
        "      raw[o.name] = v  # (blocks, M)\n",
        "      raw[o.name] = jnp.sum(v, axis=0)[None]\n",
        ("tests/test_dispatch.py", "-k", "column_groups_per_block"),
        "the blocks' row partials are added before the step's finish (a log-sum-exp's maxima)"),
    Mutation(
        "xla_whole_matrix_for_column_groups", "coda_jax/dispatch.py",
        "  return group if group > 1 and n % group == 0 else n\n",
        "  return n\n",
        ("tests/test_dispatch.py", "-k", "column_groups_per_block or program_size"),
        "the XLA program runs column-grouped steps on the whole matrix (a slice per head)"),
    Mutation(
        "column_value_other_vector_slot", "pallas_kernels/gemm_mgpu.py",
        'return lambda col: smem["i_" + nm][wg, vslot, j * en + col]',
        'return lambda col: smem["i_" + nm][wg, 0, j * en + col]',
        ("tests/test_primitives.py", "-k", "head_branch_reads_each_tiles_flags"),
        "tile.column_value reads the first vector buffer, not this tile's, when the next "
        "tile's vectors load under this one"),
    Mutation(
        "kernel_cond_branches_swapped", "pallas_kernels/epilogue.py",
        "return jax.lax.cond(pred, if_true, if_false, *args)",
        "return jax.lax.cond(pred, if_false, if_true, *args)",
        ("tests/test_qk_norm.py", "-k", "op_and_grads_kernel"),
        "the kernel's tile.cond runs the other branch"),
    Mutation(
        "xla_cond_branches_swapped", "coda_jax/dispatch.py",
        "jnp.where(pred, a, b)", "jnp.where(pred, b, a)",
        ("tests/test_qk_norm.py", "-k", "op_and_grads_xla and hq4_hkv2_hd32"),
        "the XLA implementation's Env.cond selects the other branch"),
    Mutation(
        "qk_norm_k_heads_get_q_weight", "coda_jax/qk_norm.py",
        "jnp.tile(k_norm_w.astype(jnp.float32), n_kv_heads)",
        "jnp.tile(q_norm_w.astype(jnp.float32), n_kv_heads)",
        ("tests/test_qk_norm.py", "-k", "forward_against_float64"),
        "q_norm's weight applied to the k heads"),
    Mutation(
        "qk_norm_dk_w_from_q_columns", "coda_jax/qk_norm.py",
        "dk_w = dweight[n_q * hd:(n_q + n_kv) * hd]",
        "dk_w = dweight[:n_kv * hd]",
        ("tests/test_qk_norm.py", "-k", "op_and_grads_xla and hq4_hkv2_hd32"),
        "k_norm's gradient summed over q heads' columns"),
    Mutation(
        "qk_norm_grad_drops_projection", "coda_jax/qk_norm.py",
        "du = (dn - n * c[:, None]) * rho", "du = dn * rho",
        ("tests/test_qk_norm.py", "-k", "op_and_grads_xla and hq4_hkv2_hd32"),
        "the per-head norm backward loses its projection term -n <dn, n> / hd"),
    Mutation(
        "qk_norm_eps_from_theta", "coda_jax/qk_norm.py",
        "heads[2], heads[5], impl)", "heads[2], heads[3], impl)",
        ("tests/test_qk_norm.py", "-k", "forward_against_float64"),
        "the forward takes its eps from the wrong slot of the heads tuple (theta)"),
    Mutation(
        "qk_norm_eps_dropped_forward", "coda_jax/qk_norm.py",
        "rstd = _inv_rms(xb, self.eps)",
        "rstd = _inv_rms(xb, 0.0)",
        ("tests/test_qk_norm.py", "-k", "near_and_at_zero and xla"),
        "the per-head norm forgets eps: a zero head gives 0 * inf = NaN, a head with mean "
        "square near eps moves by ~40% (missed until test_heads_near_and_at_zero)"),
    Mutation(
        "qk_norm_eps_dropped_backward", "coda_jax/qk_norm.py",
        "rho = _inv_rms(ub, self.eps)",
        "rho = _inv_rms(ub, 0.0)",
        ("tests/test_qk_norm.py", "-k", "near_and_at_zero and xla"),
        "the per-head norm's backward forgets eps (missed until "
        "test_heads_near_and_at_zero)"),
    Mutation(
        "norm_offset_skipped_on_final_norm", "flax_layers/model.py",
        '"g_final": self.head.norm_weight(),', '"g_final": self.head.norm[...],',
        ("tests/test_flax_layers.py", "-k", "norm_weight_offset_is_one_plus_g"),
        "Llama.loss passes the final norm's stored g, not 1 + g, with an offset"),
    Mutation(
        "norm_offset_skipped_on_qk_norm", "flax_layers/model.py",
        "p.update(g_q_norm=g(self.attn.q_norm), g_k_norm=g(self.attn.k_norm))",
        "p.update(g_q_norm=self.attn.q_norm[...], g_k_norm=g(self.attn.k_norm))",
        ("tests/test_flax_layers.py", "-k", "norm_weight_offset_is_one_plus_g"),
        "the q-norm weight misses the (1 + g) offset in the blocks' params"),
    Mutation(
        "bench_gpt2_baseline_drops_bias", "bench/family_blocks.py",
        'x2 = x1 + (a @ p["w2"] + p["b2"].astype(dt))', 'x2 = x1 + a @ p["w2"]',
        ("tests/test_bench_harness.py",),
        "the GPT-2 block benchmark's XLA baseline drops a bias: its speed ratio would "
        "compare different math"),
    Mutation(
        "qk_norm_dr_times_r", "coda_jax/qk_norm.py",
        "return (dh, udu / r,", "return (dh, udu * r,",
        ("tests/test_qk_norm.py", "-k", "op_and_grads_xla and hq4_hkv2_hd32"),
        "the input norm's dr multiplies by r instead of dividing"),
    # ---- the Qwen3 path in flax_layers --------------------------------------------------
    Mutation(
        "qwen3_hf_q_k_norm_names_swapped", "flax_layers/checkpoint.py",
        '_QK_NORM = {"q_norm": ("self_attn.q_norm.weight", ("attn", "q_norm")),\n'
        '            "k_norm": ("self_attn.k_norm.weight", ("attn", "k_norm"))}',
        '_QK_NORM = {"q_norm": ("self_attn.k_norm.weight", ("attn", "q_norm")),\n'
        '            "k_norm": ("self_attn.q_norm.weight", ("attn", "k_norm"))}',
        ("tests/test_flax_layers.py", "-k", "standard_layout"),
        "Qwen3's q_norm and k_norm swapped in checkpoint conversion (a round trip hides it)"),
    Mutation(
        "qwen3_block_qk_norm_swapped", "flax_layers/model.py",
        'return (p["g_q_norm"], p["g_k_norm"]) if "g_q_norm" in p else None',
        'return (p["g_k_norm"], p["g_q_norm"]) if "g_q_norm" in p else None',
        ("tests/test_flax_layers.py", "-k", "standard_layout"),
        "the model hands k_norm's weight to q and q_norm's to k (both paths alike)"),
    Mutation(
        "qwen3_hf_head_dim_derived", "flax_layers/config.py",
        'head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,',
        'head_dim=hf["hidden_size"] // heads,',
        ("tests/test_hf_checkpoint.py", "-k", "qwen3_hf_config"),
        "Qwen3's explicit head_dim ignored (128 read as hidden_size / heads = 64)"),
    # ---- GPT-2 (flax_layers/gpt2.py) -----------------------------------------------------
    Mutation(
        "gpt2_hf_export_linear_layout", "flax_layers/gpt2.py",
        'out.update({f"{_PREFIX}h.{i}.{n}": stacked[i] for i in range(model.config.n_layers)})',
        'out.update({f"{_PREFIX}h.{i}.{n}": stacked[i].T for i in range(model.config.n_layers)})',
        ("tests/test_gpt2.py", "-k", "hf_round_trip"),
        "the export writes nn.Linear's (out, in) matrices instead of Conv1D's (in, out)"),
    Mutation(
        "gpt2_hf_import_transposes_square", "flax_layers/gpt2.py",
        '    put(getattr(model.layers, k), jnp.stack(layers), f"h.*.{n} (stacked)")',
        '    if layers[0].ndim == 2 and layers[0].shape[0] == layers[0].shape[1]:\n'
        '      layers = [v.T for v in layers]\n'
        '    put(getattr(model.layers, k), jnp.stack(layers), f"h.*.{n} (stacked)")',
        ("tests/test_gpt2.py", "-k", "hf_round_trip"),
        "the import transposes c_proj (D, D), the one matrix whose shape check cannot see it"),
    # ---- our checkpoint files loaded by transformers (tests/test_hf_interop.py);
    # both are symmetric, so that a save-and-load round trip of our own cannot see them
    Mutation(
        "hf_gate_up_names_swapped", "flax_layers/checkpoint.py",
        '"w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",',
        '"w_gate": "mlp.up_proj.weight", "w_up": "mlp.gate_proj.weight",',
        ("tests/test_hf_interop.py",),
        "the Llama files name the SwiGLU gate up_proj and the up projection gate_proj"),
    Mutation(
        "gpt2_hf_ln_names_swapped", "flax_layers/gpt2.py",
        '"norm_attn": "ln_1.weight", "norm_attn_bias": "ln_1.bias",\n'
        '             "c_attn": "attn.c_attn.weight", "c_attn_bias": "attn.c_attn.bias",\n'
        '             "c_proj": "attn.c_proj.weight", "c_proj_bias": "attn.c_proj.bias",\n'
        '             "norm_mlp": "ln_2.weight",',
        '"norm_attn": "ln_2.weight", "norm_attn_bias": "ln_1.bias",\n'
        '             "c_attn": "attn.c_attn.weight", "c_attn_bias": "attn.c_attn.bias",\n'
        '             "c_proj": "attn.c_proj.weight", "c_proj_bias": "attn.c_proj.bias",\n'
        '             "norm_mlp": "ln_1.weight",',
        ("tests/test_hf_interop.py", "-k", "gpt2"),
        "the GPT-2 files swap the two LayerNorms' weights (ln_1 named ln_2)"),
    Mutation(
        "gpt2_positions_from_one", "flax_layers/gpt2.py",
        "positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),",
        "positions = jnp.broadcast_to(jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.int32),",
        ("tests/test_gpt2.py", "-k", "hf_round_trip"),
        "default positions start at 1: wpe read one row off (both paths alike)"),
    Mutation(
        "gpt2_fused_c_proj_bias_dropped", "flax_layers/gpt2.py",
        '      p["mlp_proj"], p["mlp_proj_bias"], proj_bias=p["c_proj_bias"], eps=c.eps,',
        '      p["mlp_proj"], p["mlp_proj_bias"], proj_bias=None, eps=c.eps,',
        ("tests/test_gpt2.py", "-k", "loss_and_every_gradient"),
        "the fused block's c_proj bias is dropped (the reference path keeps it)"),
    # ---- the 3-GEMM LM head (coda_jax/fused_ops.py) --------------------------------------
    Mutation(
        "lm_unit_dw_not_accumulated", "coda_jax/fused_ops.py",
        "return (S.head_weight_grad(n, dlogits, impl, w_nk, accumulate=dw), sums), (lse, tgt, ys)",
        "return (S.head_weight_grad(n, dlogits, impl, w_nk, accumulate=None), sums), (lse, tgt, ys)",
        ("tests/test_losses.py", "-k", "loss_and_grads and sum_chunked"),
        "the forward-formed dW keeps only the last chunk's n^T dlogits"),
    Mutation(
        "lm_unit_dr_times_r", "coda_jax/fused_ops.py",
        "               zdz / rc), ()", "               zdz * rc), ()",
        ("tests/test_losses.py", "-k", "loss_and_grads and ignore_0_mean"),
        "the forward-formed dr multiplies zdz by r instead of dividing"),
    Mutation(
        "lm_unit_col_sums_not_accumulated", "coda_jax/fused_ops.py",
        "    sums = jax.tree.map(jnp.add, sums, col_sums)\n    return (S.head_weight_grad(n, ",
        "    sums = col_sums\n    return (S.head_weight_grad(n, ",
        ("tests/test_blocks.py", "-k", "scalar_loss"),
        "the 3-GEMM head's column sums (the final norm's dg) keep only the last chunk"),
    Mutation(
        "in_place_ref_outside_custom_vmap", "pallas_kernels/gemm_mgpu.py",
        "  return unclip(dict(zip(names, run(*lead, *(kernel_inputs[nm] for nm in names_in)))))",
        "  return unclip(dict(zip(names, run_in_place(*lead, *(kernel_inputs[nm] for nm in "
        "names_in)))))",
        ("tests/test_in_place.py", "-k", "checkpointed"),
        "the in-place kernel's Ref is made and frozen in the caller's trace, not inside a "
        "pure wrapper: under jax.checkpoint the re-run forward reads an unwritten Ref (dW "
        "= 0; docs/design.md#6-in-place-outputs-and-xla)"),
    Mutation(
        "lm_chunks_unrolled", "coda_jax/fused_ops.py",
        "  (dw, sums), (lse, tgt, ys) = jax.lax.scan(body, init, xs)\n",
        "  carry, outs = init, []\n"
        "  for c in range(xs[0].shape[0]):\n"
        "    carry, o = body(carry, tuple(x[c] for x in xs))\n"
        "    outs.append(o)\n"
        "  (dw, sums), (lse, tgt, ys) = carry, jax.tree.map(lambda *a: jnp.stack(a), *outs)\n",
        ("tests/test_bench_harness.py", "-k", "lowering_time"),
        "the LM head's chunk loop is written out: same values, but every chunk's kernels "
        "are lowered and compiled again (the 8B step's compile 74 -> 134 s)"),
    Mutation(
        "vocab_pad_unmasked", "coda_jax/block_gemms.py",
        '  return [P.ScaleRow("r"), P.AddBias("vmask")], dict(operands, vmask=vmask)\n',
        '  return [P.ScaleRow("r")], dict(operands, vmask=vmask)\n',
        ("tests/test_losses.py", "-k", "vocabulary"),
        "a vocabulary padded to tile, its pad columns not masked: their logits are 0, not "
        "PAD_LOGIT, and count in every softmax"),
    Mutation(
        "vocab_pad_dw_not_sliced", "coda_jax/fused_ops.py",
        "  return dw[:vocab] if w_nk else dw[:, :vocab]\n",
        "  return dw\n",
        ("tests/test_losses.py", "-k", "vocabulary"),
        "the padded head's dW keeps its pad columns (a wrong-shaped gradient)"),
    Mutation(
        "vocab_not_padded", "coda_jax/fused_ops.py",
        "  if v % VOCAB_TILE == 0:\n    return wlm, None\n",
        "  if True:\n    return wlm, None\n",
        ("tests/test_losses.py", "-k", "hub_gpt2"),
        "a vocabulary that does not tile left unpadded: on an H100 the head's GEMMs fall "
        "back to XLA"),
    Mutation(
        "xent_target_from_stored_logit", "coda_jax/block_gemms.py",
        '  program = (SoftmaxXentGrad("lse", "t", "w", "zdz", rest_lse="rest", '
        'target_logit="tgt"),\n',
        '  program = (SoftmaxXentGrad("lse", "t", "w", "zdz"),\n',
        ("tests/test_losses.py", "-k", "confident"),
        "the forward-formed head gradient takes the target's dlogit from the stored fp16 "
        "logit: exp(z_t - lse) - 1 is wrong in its leading digit on confident rows"),
    Mutation(
        "xent_recompute_target_unpatched", "coda_jax/block_gemms.py",
        "  return target_column_from_stats(out[\"dlogits\"], out[\"zdz\"], out[\"dt\"], lse, tgt, lse_rest,\n"
        "                                  targets, weight)\n",
        "  return out[\"dlogits\"], out[\"zdz\"]\n",
        ("tests/test_losses.py", "-k", "confident"),
        "the recomputing backward keeps the recomputed target dlogit (its last bits differ "
        "from the forward's lse)"),
    # ---- the exp-store LM head (head_grad="exp") --------------------------------------
    Mutation(
        "exp_store_no_fallback", "coda_jax/block_gemms.py",
        "  ok = jnp.all(jnp.abs(lse) < EXP_STORE_RANGE)",
        "  ok = jnp.all(jnp.abs(lse) < 1e9)",
        ("tests/test_losses.py", "-k", "exp_store_outside"),
        "a chunk whose lse is beyond exp's range stores exp(logits) unshifted (inf)"),
    Mutation(
        "exp_store_target_not_corrected", "coda_jax/block_gemms.py",
        "  e = set_row_columns(e, targets, -jnp.exp(rest - shift))",
        "  e = e",
        ("tests/test_losses.py", "-k", "exp"),
        "the stored exponentials keep the target's p_t: its dlogit misses the -1"),
    Mutation(
        "exp_store_target_ignores_shift", "coda_jax/block_gemms.py",
        "  e = set_row_columns(e, targets, -jnp.exp(rest - shift))",
        "  e = set_row_columns(e, targets, -jnp.exp(rest - lse))",
        ("tests/test_losses.py", "-k", "exp"),
        "the target column's value normalised by lse, where the rest of e is by the shift"),
    Mutation(
        "exp_store_zdz_without_r", "coda_jax/fused_ops.py",
        "    zdz = rc * jnp.sum(dn * hc.astype(jnp.float32), axis=1)",
        "    zdz = jnp.sum(dn * hc.astype(jnp.float32), axis=1)",
        ("tests/test_losses.py", "-k", "exp"),
        "<dlogits, logits> from dn and h without the row scale r of the logits"),
    Mutation(
        "exp_store_dw_reads_unscaled_n", "coda_jax/fused_ops.py",
        "    ns = (n * s[:, None]).astype(e.dtype)",
        "    ns = n.astype(e.dtype)",
        ("tests/test_losses.py", "-k", "exp"),
        "the dW GEMM reads n without the row scale s = w exp(shift - lse)"),
    Mutation(
        "set_row_columns_wraps_negative", "coda_jax/partitioning.py",
        "  col = jnp.where((col >= 0) & (col < n), col, n)\n",
        "",
        ("tests/test_sharding.py", "-k", "set_row_columns"),
        "a negative target (ignored rows) wraps to the last column and overwrites it"),
    Mutation(
        "exp_store_post_block_c_not_over_d", "coda_jax/blocks.py",
        "    out = dispatch.apply_program(dn, NORM_GRAD, {\"x\": x2c, \"r\": r2c, \"c\": zdz / d,",
        "    out = dispatch.apply_program(dn, NORM_GRAD, {\"x\": x2c, \"r\": r2c, \"c\": zdz,",
        ("tests/test_blocks.py", "-k", "post_block_scalar_loss and exp"),
        "the final norm's zdz term not divided by D on the exp-store path"),
    Mutation(
        "auto_head_grad_always_logits", "coda_jax/fused_ops.py",
        '  return "logits" if jnp.dtype(dtype) == jnp.float16 else "exp"',
        '  return "logits"',
        ("tests/test_losses.py", "-k", "head_grad_auto"),
        "the default head_grad runs the slower 'logits' head for bfloat16 too"),
    Mutation(
        "post_block_head_grad_unresolved", "coda_jax/blocks.py",
        "lm_chunk_rows=rows, head_grad=head_grad))",
        "lm_chunk_rows=rows))",
        ("tests/test_blocks.py", "-k", "default_head_grad"),
        "the post-block passes 'auto' through to the head unresolved"),
    Mutation(
        "nearby_m_config_not_tiling", "pallas_kernels/autotune.py",
        "    if tiles(key, cfg, clip_m):  # the nearest whose config tiles this M and K",
        "    if True:  # (planted) the nearest, tiling or not",
        ("tests/test_autotune.py", "-k", "nearby"),
        "a config tuned at a nearby M is used where it does not tile this M"),
    Mutation(
        "same_chip_before_own_nearby", "pallas_kernels/autotune.py",
        "  for kind in same_chip_kinds(key.device_kind):",
        "  for kind in (key.device_kind, *same_chip_kinds(key.device_kind)):\n"
        "    exact = dataclasses.replace(key, device_kind=kind).text()\n"
        "    for path in cache_paths():\n"
        "      if exact in _entries(path):\n"
        "        return config_from_dict(_entries(path)[exact][\"config\"]), \"tuned\"\n"
        "  for kind in same_chip_kinds(key.device_kind):",
        ("tests/test_autotune.py", "-k", "same_chip"),
        "another chip-mate's exact entry wins over the device's own entry at a nearby M"),
    Mutation(
        "same_chip_any_device", "pallas_kernels/autotune.py",
        "      return tuple(kind for kind in group if kind != device_kind)\n  return ()",
        "      return tuple(kind for kind in group if kind != device_kind)\n"
        "  return SAME_CHIP[0]",
        ("tests/test_autotune.py", "-k", "same_chip"),
        "a device of another chip runs the H100's and H200's configs"),
    Mutation(
        "same_chip_not_looked_for", "pallas_kernels/autotune.py",
        "    cfg, source = _lookup_one_kind(dataclasses.replace(key, device_kind=kind), clip_m)",
        "    cfg, source = _lookup_one_kind(key, clip_m)",
        ("tests/test_autotune.py", "-k", "same_chip"),
        "an H200 with no entry of its own gets the heuristic, not the H100's config"),
    Mutation(
        "check_env_version_not_compared", "scripts/check_env.py",
        "  if not req.specifier.contains(have, prereleases=True):",
        "  if False:",
        ("tests/test_check_env.py",),
        "an environment with another jax than the pinned one passes the check"),
    Mutation(
        "check_env_cuda_not_checked", "scripts/check_env.py",
        '  if "cuda" in extras and not errors:',
        '  if False:',
        ("tests/test_check_env.py",),
        "a CPU-only jaxlib passes where the CUDA build is asked for"),
    Mutation(
        "nearby_m_any_distance", "pallas_kernels/autotune.py",
        "        and mine <= theirs * NEARBY_FACTOR and theirs <= mine * NEARBY_FACTOR):",
        "        ):",
        ("tests/test_autotune.py", "-k", "nearby"),
        "a config tuned at any M serves, however far from this one"),
    Mutation(
        "fused_path_imports_reference", "coda_jax/blocks.py",
        "from coda_jax import unfused\n",
        "from coda_jax import unfused\nfrom coda_jax import jnp_reference as ref  # noqa\n",
        ("tests/test_layering.py",),
        "a fused module imports the jnp reference it is checked against"),
    Mutation(
        "nearby_k_not_looked_for", "pallas_kernels/autotune.py",
        '  for rank, dim in enumerate(("m", "k")):',
        '  for rank, dim in enumerate(("m",)):',
        ("tests/test_autotune.py", "-k", "nearby"),
        "a weight gradient at a token count no cache has (its K) gets the heuristic"),
    Mutation(
        "nearby_k_before_m_on_a_tie", "pallas_kernels/autotune.py",
        '      return abs(math.log(theirs / mine)), -theirs, rank, f"tuned at',
        '      return abs(math.log(theirs / mine)), -theirs, -rank, f"tuned at',
        ("tests/test_autotune.py", "-k", "nearby"),
        "an exact tie between a nearby M and a nearby K goes to K, not M as documented"),
    Mutation(
        "nearby_both_m_and_k", "pallas_kernels/autotune.py",
        "        and dataclasses.replace(key, **{dim: theirs}) == other",
        "        and dataclasses.replace(key, m=other.m, k=other.k) == other",
        ("tests/test_autotune.py", "-k", "nearby"),
        "a problem at another M and another K counts as nearby"),
    # ---- Store(add_to): the dW accumulation written by the TMA store itself -------------
    Mutation(
        "store_adds_staged_add_dropped", "pallas_kernels/gemm_mgpu.py",
        "        value = value + reader(self.adds[o.name])()",
        "        value = value",
        ("tests/test_in_place.py", "-k", "store_adds or accumulate"),
        "where the added-to operand is staged (interpreter, fresh output) it is never added"),
    Mutation(
        "store_adds_reduction_dropped", "pallas_kernels/gemm_mgpu.py",
        '    return "add" if o.name in self.reduces else None',
        "    return None",
        ("tests/test_in_place.py", "-k", "store_adds or accumulate"),
        "the in-place TMA store overwrites where it should add (compiled kernels only: the "
        "interpreter has no TMA reductions and always stages the operand)", gpu_only=True),
    # ---- the RoPE backward as an epilogue pass -------------------------------------------
    Mutation(
        "row_dot_squares", "coda_jax/primitives.py",
        "    env.store(self.name, jnp.sum(x * env.load(self.other).astype(jnp.float32), axis=1))",
        "    env.store(self.name, jnp.sum(x * x, axis=1))",
        ("tests/test_primitives.py", "tests/test_fused_ops.py", "-k",
         "rowdot or rope_backward"),
        "RowDot sums x^2 instead of x * other"),
    Mutation(
        "rope_grad_c_not_over_d", "coda_jax/block_gemms.py",
        '  return out["dz"], out["c"] / d_model',
        '  return out["dz"], out["c"]',
        ("tests/test_fused_ops.py", "-k", "rope_backward"),
        "c = <dqkv, qkv> not divided by the norm's width"),
    # ---- M clipped by TMA instead of padded ----------------------------------------------
    Mutation(
        "clip_m_floor_tiles", "pallas_kernels/gemm_mgpu.py",
        "  m_iters, n_iters, k_iters = -(-m // cluster_tile_m), n // cluster_tile_n, k // tk\n"
        "  share_a",
        "  m_iters, n_iters, k_iters = m // cluster_tile_m, n // cluster_tile_n, k // tk\n"
        "  share_a",
        ("tests/test_dispatch.py", "tests/test_fused_ops.py", "-k",
         "padded or token_counts"),
        "the cooperative kernel drops the clipped last row of tiles (GPU only: the "
        "interpreter pads instead)", gpu_only=True),
    Mutation(
        "clip_m_under_a_step_that_moves_zero", "coda_jax/dispatch.py",
        "  return zero_rows_ok(call) and m % pk.CLIP_M_MULTIPLE == 0",
        "  return m % pk.CLIP_M_MULTIPLE == 0",
        ("tests/test_dispatch.py", "-k", "clip"),
        "M clipped where the rows past it would reach column sums with nonzero values"),
    Mutation(
        "pass_placeholders_cross_the_split", "coda_jax/partitioning.py",
        "  ps = _Pass(sc, a.dtype, m, n) if k == 0 else None",
        "  ps = None",
        ("tests/test_sharding.py", "-k", "qkv_rope and jit"),
        "an epilogue pass's zero-size a and b passed into shard_map: XLA's CPU compiler "
        "segfaults (the fixture's subprocess dies)"),
    # ---- the benchmarks' measuring tools ------------------------------------------------
    Mutation(
        "rounds_not_alternated", "bench/block.py",
        "    for name, fn, args in (order if i % 2 == 0 else order[::-1]):",
        "    for name, fn, args in order:",
        ("tests/test_bench_harness.py", "-k", "timed_rounds"),
        "--rounds times ours first in every round: a machine that drifts over the run "
        "biases every round's ratio the same way"),
    Mutation(
        "hlo_copies_counts_fusion_bodies", "bench/step_profile.py",
        "    if m and computation not in fused and (m.re is _COPY",
        "    if m and (m.re is _COPY",
        ("tests/test_bench_harness.py", "-k", "hlo_copies"),
        "a copy inside a fusion's computation (part of its kernel) listed as a copy of "
        "the step"),
    # ---- the program cache: a stale program served is a silent wrong answer -------------
    Mutation(
        "program_key_skips_nested_jaxprs", "pallas_kernels/kernel_cache.py",
        '      self.jaxpr(getattr(v, "jaxpr", v), getattr(v, "consts", ()))\n',
        '      self.add("a jaxpr")\n',
        ("tests/test_program_cache.py", "-k", "inside_kernels"),
        "the key hashes a nested program's presence, not its body (as jax's printed form "
        "does for kernel bodies): two kernels differing in pipeline depth or epilogue share "
        "a cache entry"),
    Mutation(
        "program_key_skips_constant_bytes", "pallas_kernels/kernel_cache.py",
        "    self.h.update(a.tobytes())\n",
        "    pass\n",
        ("tests/test_program_cache.py", "-k", "lowering_reads"),
        "a constant's shape and dtype enter the key but not its values: a program closing "
        "over other numbers loads the old one"),
    Mutation(
        "program_key_ignores_donation", "coda_jax/program_cache.py",
        '  fp.add("donate", repr(tuple(donate_argnums)))\n',
        "",
        ("tests/test_program_cache.py", "-k", "lowering_reads"),
        "the donated arguments are not in the key (they are not in the traced program): a "
        "step without donation loads one that deletes its inputs"),
    # ---- GPT-2's stored GELU slope, 192-row ping-pong tiles -----------------------------
    Mutation(
        "gelu_slope_stores_gelu", "coda_jax/layernorm_ops.py",
        "    env.store(self.slope, df)\n",
        "    env.store(self.slope, f)\n",
        ("tests/test_layernorm_ops.py", "-k", "gelu_is_gpt2s or (op_and_grads_xla and mlp)"),
        "the forward stores gelu(z) where the backward expects gelu'(z)"),
    Mutation(
        "mlp_slope_backward_skips_slope", "coda_jax/layernorm_ops.py",
        '    slope, ops = slope_multiplier("s", s.dtype), {"s": s}',
        '    slope, ops = AddTile("s"), {"s": s}',
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and mlp"),
        "the backward's first GEMM adds the stored slope where it multiplies by it"),
    # ---- the one-byte GELU slope ---------------------------------------------------------
    Mutation(
        "slope_code_truncates", "coda_jax/layernorm_ops.py",
        "+ jnp.float32(0.5 - SLOPE_CODE_LO / SLOPE_CODE_STEP), 0.0, 255.5)",
        "+ jnp.float32(-SLOPE_CODE_LO / SLOPE_CODE_STEP), 0.0, 255.5)",
        ("tests/test_layernorm_ops.py", "-k", "gelu_slope_code"),
        "the slope's code truncates instead of rounding: up to a whole step off, biased"),
    Mutation(
        "slope_decode_without_offset", "coda_jax/layernorm_ops.py",
        "    return MulTile(name, scale=SLOPE_CODE_STEP, offset=SLOPE_CODE_LO)",
        "    return MulTile(name, scale=SLOPE_CODE_STEP)",
        ("tests/test_layernorm_ops.py", "-k", "gelu_slope_code or (op_and_grads_xla and mlp)"),
        "the backward decodes the slope's code without the range's low end"),
    # ---- the next LayerNorm's statistics from GPT-2's MLP ------------------------------
    Mutation(
        "mlp_next_norm_bwd_passes_dx", "coda_jax/layernorm_ops.py",
        "  dout, db2, dg_next = stats_cotangent(xo, g_next, muo, ro, cts, impl)\n",
        "  dout, db2, dg_next = (cts[0], jnp.sum(cts[0].astype(_F32), axis=0),\n"
        "                        jnp.zeros(g_next.shape, _F32))\n",
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and next_norm"),
        "the MLP's backward takes only the output's cotangent, dropping what flowed back "
        "through the next LayerNorm's (h, mu, r)"),
    Mutation(
        "ln_input_grad_dg_without_x", "coda_jax/layernorm_ops.py",
        "    env.store_column_sum(self.dg, dh * x)\n",
        "    env.store_column_sum(self.dg, dh)\n",
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and residual_layernorm"),
        "the producer pass sums dh alone for g's gradient, not dh x"),
    Mutation(
        "mlp_next_norm_scales_by_own_g", "coda_jax/layernorm_ops.py",
        "    out = residual_stats(first[\"a\"], w2.astype(dt), x, g_next, [AddBias(\"b\")],",
        "    out = residual_stats(first[\"a\"], w2.astype(dt), x, g, [AddBias(\"b\")],",
        ("tests/test_layernorm_ops.py", "-k", "op_and_grads_xla and next_norm"),
        "h' = out * g of the MLP's own LayerNorm instead of the next one's"),
    Mutation(
        "norm_columns_one_part", "coda_jax/layernorm_ops.py",
        "NORM_COLUMN_PARTS = 3\n",
        "NORM_COLUMN_PARTS = 1\n",
        ("tests/test_layernorm_ops.py", "-k", "rows_with_mean_offset and layernorm_matmul"),
        "g @ W and beta @ W from g and beta cut to 16 bits: the mean term no longer "
        "cancels against h @ W"),
    Mutation(
        "pass_next_tile_fetches_this_tile", "pallas_kernels/gemm_mgpu.py",
        "            lambda: self._fetch_tiles(s + self.in_slots - count, next_row, next_col))",
        "            lambda: self._fetch_tiles(s + self.in_slots - count, row_base, col_base))",
        ("tests/test_primitives.py", "-k", "no_product and next_tile"),
        "a pass loads the next tile's first operand sub-tiles from this tile's rows"),
    Mutation(
        "pass_next_tile_vectors_same_buffer", "pallas_kernels/gemm_mgpu.py",
        "        pl.when(has_next)(lambda: ep.prefetch_vectors(next_row, next_col, 1 - t % 2))",
        "        pl.when(has_next)(lambda: ep.prefetch_vectors(next_row, next_col, t % 2))",
        ("tests/test_primitives.py", "-k", "no_product and next_tile"),
        "the next tile's row and column operands overwrite the buffer this tile reads"),
    Mutation(
        "per_tile_sum_forgets_rows_above", "pallas_kernels/gemm_mgpu.py",
        "    total = value if i == 0 else self.running.pop(name) + value\n",
        "    total = value  # (planted)\n"
        "    self.running.pop(name, None)\n",
        ("tests/test_primitives.py", "-k", "per_tile"),
        "a column partial carried down the tile keeps only its last row of sub-tiles"),
    Mutation(
        "heuristic_column_sums_ignore_register_cap", "pallas_kernels/gemm_mgpu.py",
        "      and carried_column_registers(cfg, outputs) <= COLUMN_SUMS_PER_TILE_MAX_REGISTERS):\n",
        "      ):  # (planted)\n",
        ("tests/test_autotune.py", "-k", "heuristic_carries"),
        "the heuristic carries column sums down the tile however many registers they "
        "take (the QK-norm backward's 64 x 128 sub-tiles ran 1.63x slower so)"),
    Mutation(
        "per_tile_partial_row_by_subtile", "pallas_kernels/gemm_mgpu.py",
        "    return ref.at[r0 // self.cfg.column_partial_rows, cols]",
        "    return ref.at[r0 // self.cfg.epi_tile_m, cols]",
        ("tests/test_primitives.py", "-k", "per_tile"),
        "a per-tile column partial lands in the row of its last sub-tile, not its tile"),
    Mutation(
        "explicit_config_never_clips", "coda_jax/dispatch.py",
        "    pm, pk_, clip_m = m, k, (interpret is None and m % call.config.cluster_tile[0] != 0\n",
        "    pm, pk_, clip_m = m, k, (False and m % call.config.cluster_tile[0] != 0\n",
        ("tests/test_dispatch.py", "-k", "explicit_config_clips"),
        "a caller's 192-row config at M = 16384 runs unclipped: the kernel refuses it"),
    Mutation(
        "gpt2_next_norm_off_by_one", "flax_layers/gpt2.py",
        '               **{"next_" + k: p[k][1:] for k in _ATTN}}',
        '               **{"next_" + k: p[k][:-1] for k in _ATTN}}',
        ("tests/test_gpt2.py", "-k", "loss_and_every_gradient and slope"),
        "step i's op applies layer i's own LN_1 and c_attn after its MLP instead of layer "
        "i+1's"),
    Mutation(
        "challenge_drops_current_config", "bench/tune_gemm.py",
        "  return [current] + [c for c in found if c != current]",
        "  return [c for c in found if c != current]",
        ("tests/test_bench_harness.py", "-k", "challengers"),
        "the challenge times only the tall candidates, so a slower one replaces the "
        "current config"),
    Mutation(
        "challenge_tile_n_ignored", "bench/tune_gemm.py",
        "  found, _ = problem.candidates(extra=extra, tile_m=tile_m, tile_n=tile_n)",
        "  found, _ = problem.candidates(extra=extra, tile_m=tile_m)",
        ("tests/test_bench_harness.py", "-k", "challengers"),
        "--challenge-tile-n times every candidate of the search, not only the 192-wide ones"),
    Mutation(
        "candidates_tile_n_filter_dropped", "pallas_kernels/autotune.py",
        "    structures = [s for s in structures if s.tile_n == tile_n]",
        "    structures = structures",
        ("tests/test_autotune.py", "-k", "wide_candidates"),
        "the search's tile_n filter keeps every structure"),
    Mutation(
        "wide_tiles_cluster_along_n_only", "pallas_kernels/autotune.py",
        "                S(PP, 128, 192, M_, M_, N_), S(PP, 128, 192, M_, N_, N_),",
        "                S(PP, 128, 192, M_, N_, N_), S(PP, 128, 192, M_, N_, N_),",
        ("tests/test_autotune.py", "-k", "wide_candidates"),
        "the ping-pong 128 x 192 tiles (the H200's fastest plain GEMM at N = 6144 and 12288) "
        "are never clustered along M"),
    Mutation(
        "pick_best_ignores_margin", "pallas_kernels/autotune.py",
        "  if keep is not None and keep in times and times[keep] <= times[best] * (1 + keep_within):",
        "  if keep is not None and keep in times and times[keep] <= times[best]:",
        ("tests/test_autotune.py", "-k", "pick_best"),
        "a challenger 0.5% faster (within the timings' spread) replaces the current config"),
    # ---- B's sums over K in the mainloop (a weight gradient's bias gradient) -------------
    Mutation(
        "b_sum_every_tile_takes_the_same_steps", "pallas_kernels/gemm_mgpu.py",
        "    mine = kk % rows_of_tiles == row_base // self.cfg.tile_m\n",
        "    mine = kk % rows_of_tiles == 0\n",
        ("tests/test_gemm_mainloop.py", "-k", "b_column_sum"),
        "every row of tiles sums the K steps of row 0: those are counted once per row "
        "and the others never"),
    Mutation(
        "b_sum_partials_to_row_zero", "pallas_kernels/gemm_mgpu.py",
        "        row_base // self.cfg.tile_m,\n",
        "        0,\n",
        ("tests/test_gemm_mainloop.py", "-k", "b_column_sum"),
        "every tile stores its share of the sums into the first row of partials: the "
        "others stay unwritten and row 0 keeps whichever tile stored last"),
    Mutation(
        "b_sum_k_shards_not_added", "coda_jax/partitioning.py",
        "                                 b_column_sums=lambda: jax.lax.psum(local_sums(), layout.k))",
        "                                 b_column_sums=local_sums)",
        ("tests/test_sharding.py", "-k", "b_column_sums"),
        "with the weight gradient's rows split over devices, the bias gradient is one "
        "shard's partial sum"),
    Mutation(
        "b_sum_added_over_row_shards", "coda_jax/partitioning.py",
        "      if how == \"whole_per_row_shard\":\n        continue\n",
        "      if how == \"whole_per_row_shard\":\n        how = \"sum\"\n",
        ("tests/test_sharding.py", "-k", "b_column_sums"),
        "with M split every shard's sums of B are whole, and adding them multiplies the "
        "bias gradient by the shard count"),
    # ---- row totals: row sums over all N, exchanged across the grid mid-epilogue ---------
    Mutation(
        "row_totals_do_not_wait", "pallas_kernels/gemm_mgpu.py",
        "    plgpu.semaphore_wait(semaphore, self.total_tiles, decrement=False, "
        "memory_scope=\"gpu\")\n",
        "",
        ("tests/test_row_totals.py", "-k", "test_row_totals["),
        "a tile reads its row block's partials without waiting for the other tiles to "
        "publish them (GPU only: the interpreter cannot run the exchange)", gpu_only=True),
    Mutation(
        "row_totals_sum_one_tile", "pallas_kernels/gemm_mgpu.py",
        "                   for c in range(self.total_tiles)]\n",
        "                   for c in range(1)]\n",
        ("tests/test_row_totals.py", "-k", "test_row_totals["),
        "the totals are the first tile's partials alone, not the row's (GPU only)",
        gpu_only=True),
    Mutation(
        "row_totals_allow_cooperative", "pallas_kernels/gemm_mgpu.py",
        "  if cfg.schedule != Schedule.PINGPONG:\n    return (\"the cooperative",
        "  if False:\n    return (\"the cooperative",
        ("tests/test_row_totals.py", "-k", "refuse"),
        "a cooperative config, whose two warpgroups would wait for each other, gets through"),
    Mutation(
        "row_totals_first_pass_stages_nothing", "pallas_kernels/gemm_mgpu.py",
        "        row_totals_reads=row_totals_pass_reads(row_totals_pass, staged(in_place),\n"
        "                                               input_dtypes, outputs, config))\n",
        "        row_totals_reads=())\n",
        ("tests/test_row_totals.py", "-k", "lower"),
        "the first pass stages none of the tile operands it reads"),
    Mutation(
        "row_terms_drop_dx", "coda_jax/layernorm_ops.py",
        "    dxt = (tile.load(\"dx\").astype(_F32) + r[:, None] * (gcol * dn) - ra[:, None]\n",
        "    dxt = (r[:, None] * (gcol * dn) - ra[:, None]\n",
        ("tests/test_bench_harness.py", "-k", "row_terms"),
        "the one-GEMM LayerNorm input gradient forgets x's cotangent from the residual "
        "(its program, run on the CPU as the kernel runs it)"),
    Mutation(
        "half_block_fallback_drops_producer_dg", "coda_jax/layernorm_ops.py",
        "  return dxt, n, dbeta, dg + dg_producer, dsum\n",
        "  return dxt, n, dbeta, dg, dsum\n",
        ("tests/test_layernorm_ops.py", "-k", "test_op_and_grads_xla and residual_layernorm_gelu"),
        "the half block's two-kernel backward drops the producer's share of g's gradient"),
    Mutation(
        "shifted_op_next_norm_drops_dx", "coda_jax/layernorm_ops.py",
        "        dzn, w_n.astype(dzn.dtype), None, xo, dxo.astype(xo.dtype), muo, ro, g_next, beta_n,\n",
        "        dzn, w_n.astype(dzn.dtype), None, xo, jnp.zeros_like(xo), muo, ro, g_next, beta_n,\n",
        ("tests/test_layernorm_ops.py", "-k", "test_op_and_grads_xla and next_qkv"),
        "the shifted op's backward drops out's own cotangent (the residual stream's) beside "
        "the next LayerNorm's"),
    Mutation(
        "layernorm_grad_from_x_reads_h", "coda_jax/layernorm_ops.py",
        "    return (x - mu) * g\n",
        "    return x - mu * g\n",
        ("tests/test_layernorm_ops.py", "-k", "test_op_and_grads_xla and residual_layernorm_gelu"),
        "the one-GEMM input gradient's fallback takes its x operand for h = x g"),
    # ---- LayerNorm's one-GEMM input gradient on sharded arrays ---------------------------
    Mutation(
        "row_terms_rows_split_cols_unsummed", "coda_jax/layernorm_ops.py",
        "  if layout.m:\n    cols = [jax.lax.psum(c, layout.m) for c in cols]\n",
        "",
        ("tests/test_sharding.py", "-k", "row_terms"),
        "with the rows split, each device's column sums (dbeta, dg, a bias's) are its own "
        "rows' only"),
    Mutation(
        "row_terms_cols_split_local_mean", "coda_jax/layernorm_ops.py",
        "                        d=x.shape[1] * (jax.lax.axis_size(layout.n) if layout.n else 1))",
        "                        d=x.shape[1])",
        ("tests/test_sharding.py", "-k", "row_terms"),
        "with D split, the row terms' means divide by the shard's columns, not the row's"),
    Mutation(
        "row_terms_cols_split_totals_unsummed", "coda_jax/layernorm_ops.py",
        "    sum_n = (lambda t: jax.lax.psum(t, layout.n)) if layout.n else (lambda t: t)\n",
        "    sum_n = lambda t: t\n",
        ("tests/test_sharding.py", "-k", "row_terms"),
        "with D split, the row totals are the shard's columns' only"),
    Mutation(
        "row_terms_contraction_gathered", "coda_jax/layernorm_ops.py",
        "  layout = partitioning.choose_layout(_ROW_TERMS_SPLIT, mesh, shapes)\n",
        "  layout = dataclasses.replace(partitioning.choose_layout(_ROW_TERMS_SPLIT, mesh, "
        "shapes), k=())\n",
        ("tests/test_sharding.py", "-k", "row_terms"),
        "a split contraction is gathered (dz, w: activation-sized) instead of summing dn"),
    Mutation(
        "row_terms_check_on_sharded_types", "coda_jax/layernorm_ops.py",
        "      jax.eval_shape(gemm, *(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in args))\n",
        "      jax.eval_shape(gemm, *args)\n",
        ("tests/test_sharding.py", "-k", "one_gemm_on_split_rows"),
        "the trace-time check hands the kernel explicitly sharded types, which it refuses: "
        "on explicit mesh axes the op falls back"),
    Mutation(
        "row_terms_multi_device_falls_back", "coda_jax/layernorm_ops.py",
        "      if jax.device_count() == 1:\n        return gemm(*args)\n",
        "      if jax.device_count() > 1:\n        raise ValueError(\"several devices\")\n"
        "      if jax.device_count() == 1:\n        return gemm(*args)\n",
        ("tests/test_sharding.py", "-k", "one_gemm_on_split_rows"),
        "the one GEMM refused on any host with several devices (as it once was)"),
    Mutation(
        "row_split_sum_not_psummed", "coda_jax/sharding.py",
        "    return out if per_row else jax.lax.psum(out, split.axis)\n",
        "    return out if per_row else jax.lax.pmean(out, split.axis)\n",
        ("tests/test_sharding.py", "-k", "row_split_matches_jit"),
        "the devices' loss sums averaged, not summed"),
    Mutation(
        "row_split_mean_over_local_count", "flax_layers/layers.py",
        "  total = sum_over_rows(lambda *a: fn(*a, \"sum\"), row_split, rows, shared)\n",
        "  total = sum_over_rows(lambda *a: fn(*a, \"mean\"), row_split, rows, shared)\n",
        ("tests/test_sharding.py", "-k", "row_split_matches_jit"),
        "each device's mean over its own counted targets, summed"),
    Mutation(
        "lm_head_invariant_r_grad_unsummed", "coda_jax/fused_ops.py",
        "    return (dh.astype(hdt.dtype), reduce_like(dr, rdt),",
        "    return (dh.astype(hdt.dtype), dr,",
        ("tests/test_sharding.py", "-k", "row_split_matches_jit"),
        "an r made alike on every device (GPT-2's ones) gets a varying dr under shard_map"),
    Mutation(
        "train_step_ignores_loss_row_split", "flax_layers/train.py",
        "    row_split = RowSplit(mesh, data_axis, loss_per_device=loss_row_split)\n",
        "    row_split = RowSplit(mesh, data_axis, loss_per_device=False)\n",
        ("tests/test_sharding.py", "-k", "head_gradient_once"),
        "the train step never runs the head per device"),
    Mutation(
        "fsdp_splits_the_layer_axis", "flax_layers/train.py",
        "    dim = max(split, key=lambda d: (shape[d], d))\n",
        "    dim = split[0]\n",
        ("tests/test_sharding.py", "-k", "fsdp_shardings_split_inside or jit_train_step_fsdp"),
        "FSDP splits a stack of layers along its layer axis (XLA gathers the whole stack)"),
    Mutation(
        "layer_weights_not_gathered", "flax_layers/layers.py",
        "  return tree if row_split is None else row_split.whole(tree)\n",
        "  return tree\n",
        ("tests/test_sharding.py", "-k", "jit_train_step_fsdp"),
        "the layer scan leaves FSDP-split weights split: jit moves activations instead"),
    Mutation(
        "train_temp_check_skipped", "bench/train.py",
        "  if not temp_bytes:\n    return None\n",
        "  if True:\n    return None\n",
        ("tests/test_main_job.py", "-k", "scratch_buffer"),
        "a step whose scratch buffer fits in no free piece runs into an out-of-memory error "
        "(on several devices, a hang)"),
    Mutation(
        "train_paths_share_a_process", "bench/train.py",
        "  args.spawn = len(args.paths) > 1 and not args.one_process and args.child_result is None\n",
        "  args.spawn = False\n",
        ("tests/test_main_job.py", "-k", "own_process or own_command"),
        "the second path compiles on a device the first has not given back (the 80 GB "
        "H100's out-of-memory)"),
    Mutation(
        "hf_rope_parameters_ignored", "flax_layers/config.py",
        "  params = hf.get(\"rope_parameters\")\n",
        "  params = None\n",
        ("tests/test_hf_config.py",),
        "a transformers-5 config.json loads with theta 10000 and no scaling, silently"),
    Mutation(
        "kernel_key_ignores_the_kernel", "pallas_kernels/kernel_cache.py",
        "  fp.jaxpr(jaxpr.jaxpr, jaxpr.consts)\n  return fp.hexdigest()\n",
        "  return fp.hexdigest()\n",
        ("tests/test_kernel_cache.py", "-k", "key_follows or lowered_once"),
        "every kernel gets one key: the first one lowered runs in place of all the others"),
    Mutation(
        "kernel_cache_not_kept", "pallas_kernels/kernel_cache.py",
        "  with _lock:\n    _exported[key] = exp\n",
        "",
        ("tests/test_kernel_cache.py", "-k", "lowered_once"),
        "a kernel is lowered again at every call site of the process"),
    Mutation(
        "cache_read_not_marked_used", "pallas_kernels/kernel_cache.py",
        "  try:\n    os.utime(path)\n  except OSError:",
        "  try:\n    pass\n  except OSError:",
        ("tests/test_kernel_cache.py", "-k", "bound"),
        "a cache folder over its bound deletes the kernel in use when it is the oldest "
        "written"),
    Mutation(
        "prune_deletes_other_files", "pallas_kernels/kernel_cache.py",
        "      if entry.fullmatch(p.name):\n",
        "      if p.name.endswith(SUFFIX):\n",
        ("tests/test_kernel_cache.py", "tests/test_program_cache.py", "-k", "bound or prune"),
        "the kernel and program caches delete each other's files when they share a folder"),
    Mutation(
        "prune_ignores_the_bound", "pallas_kernels/kernel_cache.py",
        "    if total <= limit:\n      break\n",
        "    if total <= 2 * limit:\n      break\n",
        ("tests/test_kernel_cache.py", "-k", "bound or prune"),
        "a cache folder grows to twice its bound"),
    # ---- the heuristic's tall ping-pong tiles --------------------------------------------
    Mutation(
        "tall_tiles_waste_unchecked", "pallas_kernels/gemm_mgpu.py",
        "  return clip_m and (padded - m) <= TALL_TILE_MAX_WASTE * m\n",
        "  return clip_m\n",
        ("tests/test_autotune.py", "-k", "heuristic_tall"),
        "192-row tiles at any clipped M: a sixth of the last row of tiles' work wasted at "
        "M = 1088"),
    Mutation(
        "tall_tiles_three_stages", "pallas_kernels/gemm_mgpu.py",
        "range(5, TALL_TILE_MIN_STAGES - 1, -1)",
        "range(5, TALL_TILE_MIN_STAGES - 2, -1)",
        ("tests/test_autotune.py", "-k", "heuristic_tall"),
        "the heuristic takes tall tiles with 3 stages (up to 1.9x slower)"),
    Mutation(
        "tall_tiles_carry_any_column_sums", "pallas_kernels/gemm_mgpu.py",
        "> TALL_TILE_MAX_CARRIED_REGISTERS):",
        "> 2 * TALL_TILE_MAX_CARRIED_REGISTERS):",
        ("tests/test_autotune.py", "-k", "heuristic_tall"),
        "two column partials carried down a 192-row tile: 32 of the 40 registers left"),
    # ---- the heuristic's wide tiles ------------------------------------------------------
    Mutation(
        "wide_pingpong_at_any_k", "pallas_kernels/gemm_mgpu.py",
        "max_k=WIDE_PINGPONG_MAX_K,", "max_k=4 * WIDE_PINGPONG_MAX_K,",
        ("tests/test_autotune.py", "-k", "heuristic_wide"),
        "128 x 192 ping-pong tiles past K = 4096, where nothing was measured"),
    Mutation(
        "wide_pingpong_not_for_trans_a", "pallas_kernels/gemm_mgpu.py",
        "WIDE_PINGPONG_TRANS_A = 1\n", "WIDE_PINGPONG_TRANS_A = 0\n",
        ("tests/test_autotune.py", "-k", "heuristic_wide"),
        "the LM head's chunked dW back on cooperative 256 x 192 tiles, 4-8% slower"),
    Mutation(
        "wide_heavy_rounds_ignored", "pallas_kernels/gemm_mgpu.py",
        "  return (_wide_rounds_pay(-(-m // 128), n, gain=0.0)\n          and ",
        "  return (True\n          and ",
        ("tests/test_autotune.py", "-k", "heuristic_wide"),
        "heavy epilogues in 128 x 192 tiles where they add part of a round (1.012x)"),
    Mutation(
        "wide_cooperative_rounds_ignored", "pallas_kernels/gemm_mgpu.py",
        "  return _wide_rounds_pay(-(-m // WIDE_ROWS), n, WIDE_COOPERATIVE_GAIN)\n",
        "  return True\n",
        ("tests/test_autotune.py", "-k", "heuristic_wide"),
        "256 x 192 cooperative tiles where their one round runs 1.5x the narrow tiles' one"),
    Mutation(
        "wide_cooperative_epi_64", "pallas_kernels/gemm_mgpu.py",
        "if schedule == Schedule.PINGPONG or wide_or_tall\n",
        "if schedule == Schedule.PINGPONG\n",
        ("tests/test_autotune.py", "-k", "heuristic_wide"),
        "64-wide sub-tiles under 256 x 192 cooperative tiles: 1.07x on the 8B LM head"),
    Mutation(
        "heuristic_ab_sums_lse_rest", "bench/heuristic_ab.py",
        'if stem == s or stem.startswith(s + "_")]', "if stem == s]",
        ("tests/test_bench_harness.py", "-k", "heuristic_ab"),
        "an LSE's rest sums, relative to partial maxima, compared as plain sums (0.31 apart)"),
    Mutation(
        "heuristic_ab_inf_is_nan", "bench/heuristic_ab.py",
        "  x, y = x[finite], y[finite]\n", "",
        ("tests/test_bench_harness.py", "-k", "heuristic_ab"),
        "an overflowed exp in both configs' outputs makes the check nan, which passes"),
    Mutation(
        "one_output_slot_at_any_depth", "pallas_kernels/autotune.py",
        "deeper.stages > cfg.stages else None",
        "deeper.stages >= cfg.stages else None",
        ("tests/test_autotune.py", "-k", "one_output_slot"),
        "one output slot offered where it buys no stage (level at best: "
        "docs/tuning.md#output-slots)"),
    Mutation(
        "halves_where_no_stage_is_gained", "pallas_kernels/autotune.py",
        "                      epi_store_n=32)\n",
        "                      epi_store_n=32) or dataclasses.replace(cfg, epi_store_n=32)\n",
        ("tests/test_autotune.py", "-k", "store_in_halves"),
        "32-wide halves offered at the depth the whole sub-tiles have (more stores, no "
        "stage gained)"),
    Mutation(
        "final_round_not_in_turn", "pallas_kernels/autotune.py",
        "  for _ in range(rounds if len(leaders) > 1 else 0):  # a lone leader has no rival\n"
        "    for c in leaders:\n",
        "  for c in leaders:\n"
        "    for _ in range(rounds if len(leaders) > 1 else 0):\n",
        ("tests/test_autotune.py", "-k", "final_round"),
        "the tuner's final round times each finalist its rounds back to back, so a drift "
        "in clock or temperature falls on some finalists and not others"),
    Mutation(
        "final_round_keeps_one_outside_the_window", "pallas_kernels/autotune.py",
        "  if keep in near and keep not in leaders:\n",
        "  if keep in times and keep not in leaders:\n",
        ("tests/test_autotune.py", "-k", "final_round"),
        "the config to keep is re-timed even where its first time is far from the fastest"),
    Mutation(
        "incumbent_ignores_the_out_entry", "bench/tune_gemm.py",
        "  record = entries.get(problem.key.text())\n",
        "  record = None\n",
        ("tests/test_bench_harness.py", "-k", "incumbent"),
        "a --retune keeps what the other caches serve, not the --out file's own entry"),
    Mutation(
        "all_workers_on_the_first_gpu", "tests/worker_gpus.py",
        "  return gpus[int(m.group(1)) % len(gpus)]\n",
        "  return gpus[0]\n",
        ("tests/test_worker_gpus.py",),
        "every test worker pinned to the first GPU: the others sit idle"),
    Mutation(
        "pinned_worker_without_a_gpu_runs_on", "tests/conftest.py",
        "  if _PINNED_GPU is not None and jax.devices()[0].platform != \"gpu\":\n",
        "  if False:\n",
        ("tests/test_worker_gpus.py", "-k", "conftest"),
        "a worker given a GPU that jax does not see runs its kernels through the "
        "interpreter without a word"),
    # ---- the run's XLA compilation cache --------------------------------------------
    Mutation(
        "run_folders_left_behind", "tests/conftest.py",
        "    shutil.rmtree(folder, ignore_errors=True)\n",
        "    pass\n",
        ("tests/test_run_caches.py", "-k", "shares"),
        "every test run leaves its kernel and XLA cache folders in the temp directory"),
    Mutation(
        "xla_cache_takes_only_slow_compiles", "tests/conftest.py",
        '  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")\n',
        "  pass\n",
        ("tests/test_run_caches.py", "-k", "shares"),
        "the tests' XLA cache keeps only programs that took a second to compile: the "
        "many quick ones are compiled again in every test and worker"),
    Mutation(
        "xla_cache_replaces_the_callers", "tests/conftest.py",
        '    and "JAX_COMPILATION_CACHE_DIR" not in os.environ):\n',
        '    and os.environ.pop("JAX_COMPILATION_CACHE_DIR", None) != ""):\n',
        ("tests/test_run_caches.py", "-k", "callers"),
        "a caller's own JAX_COMPILATION_CACHE_DIR is swapped for a folder the run then "
        "removes"),
    Mutation(
        "deeper_only_counts_equal_depth", "bench/compare_configs.py",
        "return cfg is not None and cfg.stages > base.stages",
        "return cfg is not None and cfg.stages >= base.stages",
        ("tests/test_bench_harness.py", "-k", "deeper_only"),
        "--deeper-only times variants that run no deeper than the chosen config"),
    Mutation(
        "tune_gemm_served_any_config", "bench/tune_gemm.py",
        "return source if served == config else None",
        "return source",
        ("tests/test_bench_harness.py", "-k", "already_served"),
        "a winner the caches do not serve is taken as served and never written"),
    # ---- halves of 64-wide sub-tiles; long checks started early --------------------------
    Mutation(
        "background_check_started_twice", "tests/background_checks.py",
        "    if out.is_file() or started.is_file():\n      return False\n",
        "",
        ("tests/test_background_checks.py", "-k", "started_once"),
        "every worker starts its own copy of a minutes-long check"),
    Mutation(
        "background_check_outlives_its_run", "tests/background_checks.py",
        "      if not _alive(watch_pid):",
        "      if False:",
        ("tests/test_background_checks.py", "-k", "ends_with_its_run"),
        "after -x or Ctrl-C the check runs on, up to its 25-minute timeout"),
    # ---- each test's time written as it ends ----
    Mutation(
        "run_times_written_by_workers_too", "tests/run_times.py",
        '  if not path or env.get("PYTEST_XDIST_WORKER"):\n',
        "  if not path:\n",
        ("tests/test_run_times.py", "-k", "written_as_it_ends"),
        "under pytest-xdist every test's line is written twice, by its worker and by "
        "the controller"),
    Mutation(
        "run_times_leave_out_teardown", "tests/run_times.py",
        '    if report.when != "teardown":\n',
        '    if report.when != "call":\n',
        ("tests/test_run_times.py", "-k", "written_as_it_ends"),
        "a test's time leaves out its fixtures' teardown, and a test whose setup failed "
        "or skipped is never written"),
    Mutation(
        "run_times_failed_setup_passes", "tests/run_times.py",
        '      outcome = "failed" if report.when == "call" else "error"\n',
        '      outcome = "failed" if report.when == "call" else outcome\n',
        ("tests/test_run_times.py", "-k", "written_as_it_ends"),
        "a test whose fixture failed is written down as passed"),
    Mutation(
        "run_times_left_keeps_finished", "tests/run_times.py",
        "  return [i for i in dict.fromkeys(collected) if i not in finished]\n",
        "  return list(dict.fromkeys(collected))\n",
        ("tests/test_run_times.py", "-k", "left_lists"),
        "the tests a cut-off call still owes include every test it finished, so the next "
        "call reruns them all"),
    Mutation(
        "nested_pytest_writes_callers_times", "tests/helpers.py",
        '         if not k.startswith("PYTEST_") and k != run_times.TIMES_ENV}\n',
        '         if not k.startswith("PYTEST_")}\n',
        ("tests/test_run_times.py", "-k", "callers_file"),
        "the nested pytest runs of the tests write their probes' times into the "
        "caller's file"),
    Mutation(
        "readme_example_swaps_arguments", "README.md",
        "x, h, r = fused_ops.residual_rmsnorm(y, wo, x0, g_mlp)",
        "x, h, r = fused_ops.residual_rmsnorm(y, wo, g_mlp, x0)",
        ("tests/test_readme.py", "-k", "fused_ops"),
        "the README's example of the fused ops passes the residual and the norm weight in "
        "each other's places: a reader's copy would fail"),
    Mutation(
        "readme_example_left_unrun", "tests/test_readme.py",
        "    ROOT / \"docs\" / \"sharding.md\": (SHARD_MAP,),\n",
        "    ROOT / \"docs\" / \"sharding.md\": (),\n",
        ("tests/test_readme.py", "-k", "every_example"),
        "a README example no test runs (the shard_map one) goes unnoticed"),
    Mutation(
        "run_times_split_round_robin", "tests/run_times.py",
        "    k = min(range(parts), key=lambda k: (totals[k], k))\n",
        "    k = sum(len(l) for l in lists) % parts\n",
        ("tests/test_run_times.py", "-k", "split"),
        "the suite's parts are dealt in turn, not by time, so one call gets the heavy tests"),
    Mutation(
        "kernel_key_ignores_keyed_for", "pallas_kernels/kernel_cache.py",
        "  d = _key_device[-1] if _key_device else jax.devices()[0]\n",
        "  d = jax.devices()[0]\n",
        ("tests/test_bench_harness.py", "-k", "lower_only"),
        "kernels lowered for a GPU host elsewhere are keyed for this machine's device, so "
        "the host never finds them"),
    Mutation(
        "lower_only_without_the_devices_sms", "bench/tune_gemm.py",
        "        jax.export.export(problem.jitted(cfg, num_sms=device.core_count),\n",
        "        jax.export.export(problem.jitted(cfg),\n",
        ("tests/test_bench_harness.py", "-k", "lower_only"),
        "the kernels lowered for another device take this machine's SM count (its grid)"),
    Mutation(
        "kernel_trace_first_wait_in_stages", "bench/kernel_trace.py",
        '    row["first"], row["stages"] = (waits[0], sum(waits[1:])) if waits else (nan, nan)\n',
        '    row["first"], row["stages"] = (waits[0], sum(waits)) if waits else (nan, nan)\n',
        ("tests/test_kernel_trace.py", "-k", "known_trace"),
        "the mainloop's first stage wait (the other warpgroup's turn) counted as starvation"),
    Mutation(
        "kernel_trace_keeps_first_tile", "bench/kernel_trace.py",
        '  return [t for rs in compute.values() for t in tiles(rs)[1:-1]]\n',
        '  return [t for rs in compute.values() for t in tiles(rs)[:-1]]\n',
        ("tests/test_kernel_trace.py", "-k", "known_trace"),
        "each warpgroup's first tile (the pipeline filling) enters the medians"),
    Mutation(
        "store_wait_late_skipped", "pallas_kernels/gemm_mgpu.py",
        '      if deferred:\n        wait_store()\n',
        '      if deferred:\n        pass\n',
        ("tests/test_primitives.py", "-k", "output_slots and True"),
        "epi_store_wait_late writes its outputs into slots a store may still be reading"),
    Mutation(
        "challenge_rewrites_kept_entry", "bench/tune_gemm.py",
        "  if not narrowed or keep is None or chosen != keep or key_text not in entries:\n",
        "  if True or not narrowed or keep is None or chosen != keep or key_text not in entries:\n",
        ("tests/test_bench_harness.py", "-k", "keeps_the_entry"),
        "a challenge that keeps an entry rewrites it with the few configs it timed"),
    Mutation(
        "wide_pingpong_grid_m_dropped", "pallas_kernels/autotune.py",
        "                S(PP, 128, 192, M_, N_, M_, epi_widths=(32,)),\n",
        "",
        ("tests/test_autotune.py", "-k", "wide_candidates"),
        "the search loses ping-pong 128 x 192 tiles clustered along N with grid minor M"),
    Mutation(
        "tuner_skips_store_wait_late", "pallas_kernels/autotune.py",
        "          these += [deeper, dataclasses.replace(deeper, epi_store_wait_late=True)]\n",
        "          these += [deeper]\n",
        ("tests/test_autotune.py", "-k", "one_output_slot"),
        "the search never times the late store wait beside one output slot"),
    Mutation(
        "coarse_trace_notes_waits", "pallas_kernels/gemm_mgpu.py",
        '  if _trace is not None and not _trace["waits"]:\n',
        '  if _trace is None and not _trace["waits"]:\n',
        ("tests/test_kernel_trace.py", "-k", "waits_are_noted"),
        "traced(waits=False) still notes every wait, so a heavy kernel traces its start only"),
    Mutation(
        "trace_missing_waits_read_as_zero", "bench/kernel_trace.py",
        '    row["first"], row["stages"] = (waits[0], sum(waits[1:])) if waits else (nan, nan)\n',
        '    row["first"], row["stages"] = (waits[0], sum(waits[1:])) if waits else (0.0, 0.0)\n',
        ("tests/test_kernel_trace.py", "-k", "without_waits"),
        "a trace noted without waits reports zero stage waits instead of unknown"),
    Mutation(
        "trace_slot_share_without_slot_waits", "bench/kernel_trace.py",
        '          if tid not in compute and any(r[0] == "wait_slot" for r in rs)]\n',
        '          if tid not in compute and rs]\n',
        ("tests/test_kernel_trace.py", "-k", "without_waits"),
        "a memory warpgroup that noted no slot waits reads as never waiting (0.00)"),
    Mutation(
        "trace_per_warpgroup_counts_every_tile", "bench/kernel_trace.py",
        '  return min((max(len(tiles(rs)) - 2, 0) for rs in compute.values()), default=0)\n',
        '  return min((len(tiles(rs)) for rs in compute.values()), default=0)\n',
        ("tests/test_kernel_trace.py", "-k", "without_waits or known_trace"),
        "the per-warpgroup count takes the first and last tiles, which the medians leave out"),
    Mutation(
        "trace_params_ignore_free_smem", "pallas_kernels/gemm_mgpu.py",
        '  regions = min(_trace["regions"], free // (_TRACE_BYTES_PER_REGION * warpgroups))\n',
        '  regions = _trace["regions"]\n',
        ("tests/test_kernel_trace.py", "-k", "free_shared"),
        "the profiler's buffer sized as asked, past the shared memory the kernel leaves"),
    Mutation(
        "epilogue_bytes_ignore_width", "pallas_kernels/gemm_mgpu.py",
        "  return total + sum(jnp.dtype(o.dtype).itemsize * o.width for o in outputs\n",
        "  return total + sum(jnp.dtype(o.dtype).itemsize for o in outputs\n",
        ("tests/test_epilogue_bytes.py",),
        "a gated program's half-width output counted as a whole tile"),
    Mutation(
        "served_winner_dropped_after_whole_search", "bench/tune_gemm.py",
        '  return source is None or source == "tuned" or not narrowed\n',
        '  return source is None or source == "tuned"\n',
        ("tests/test_bench_harness.py", "-k", "served_winner"),
        "a whole search whose winner a sibling's entry serves leaves no record, and --list "
        "offers the problem for the same search again"),
    Mutation(
        "ptxas_report_frame_to_first_kernel", "bench/ptxas_report.py",
        "      r = reports[-1]\n",
        "      r = reports[0]\n",
        ("tests/test_bench_harness.py", "-k", "ptxas_report"),
        "every kernel's spill bytes written onto the first kernel compiled"),
    Mutation(
        "ptxas_report_spills_only_loads", "bench/ptxas_report.py",
        "    return bool(self.spill_store_bytes or self.spill_load_bytes)\n",
        "    return bool(self.spill_load_bytes and self.spill_store_bytes > 8)\n",
        ("tests/test_bench_harness.py", "-k", "ptxas_report"),
        "a kernel that spills a few bytes listed as spill-free"),
    Mutation(
        "auto_barriers_kept", "pallas_kernels/gemm_mgpu.py",
        "            unsafe_no_auto_barriers=not auto_barriers,\n",
        "            unsafe_no_auto_barriers=False,\n",
        ("tests/test_kernel_cache.py", "-k", "auto_barriers"),
        "kernels built with Pallas's auto barriers whatever the setting says"),
    Mutation(
        "auto_barriers_setting_ignored", "pallas_kernels/gemm_mgpu.py",
        '  return raw == "1"\n',
        '  return False\n',
        ("tests/test_kernel_cache.py", "-k", "auto_barriers"),
        "CODA_JAX_PALLAS_AUTO_BARRIERS=1 builds the same kernels as without it"),
    Mutation(
        "pass_accumulator_positive_zero", "pallas_kernels/gemm_mgpu.py",
        "jnp.full((tm, tn), -0.0, jnp.float32)",
        "jnp.full((tm, tn), 0.0, jnp.float32)",
        ("tests/test_primitives.py", "-k", "sign_of_zero"),
        "a pass (K = 0) starts from +0.0, which the first tile operand's add must keep "
        "(GPU only: the interpreter's XLA folds 0.0 + x to x)", gpu_only=True),
]


def _copy_tree(dst: str, tests_from: str | None) -> None:
  """The working tree (tracked and untracked-not-ignored files) into dst; with
  ``tests_from``, tests/ as it was at that commit."""
  try:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
  except (OSError, subprocess.CalledProcessError):  # a copy without git (a GPU host)
    if tests_from:
      raise SystemExit("--tests-from needs a git checkout") from None
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", "results")
    shutil.copytree(ROOT, dst, ignore=skip, dirs_exist_ok=True)
    return
  for rel in filter(None, files):
    src = os.path.join(ROOT, rel)
    if not os.path.isfile(src):  # deleted but still tracked
      continue
    os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
    shutil.copy2(src, os.path.join(dst, rel))
  if tests_from:
    shutil.rmtree(os.path.join(dst, "tests"))
    archive = subprocess.run(["git", "archive", tests_from, "tests"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)


def _plant(dst: str, mut: Mutation) -> None:
  path = os.path.join(dst, mut.file)
  with open(path) as f:
    text = f.read()
  count = text.count(mut.old)
  if count != 1:
    raise SystemExit(f"mutation {mut.name}: the text to replace occurs {count} times in "
                     f"{mut.file} (must be exactly once): update the pattern")
  with open(path, "w") as f:
    f.write(text.replace(mut.old, mut.new))


def _check_text(muts) -> int:
  """Each mutation's old text occurs exactly once in the working tree (and differs from
  new); no copy, no tests. Returns the number of stale patterns."""
  stale = 0
  for m in muts:
    try:
      with open(os.path.join(ROOT, m.file)) as f:
        count = f.read().count(m.old)
    except OSError as e:
      count, note = 0, f" ({e.strerror})"
    else:
      note = ""
    ok = count == 1 and m.old != m.new
    stale += not ok
    print(f"{m.name:40s} {m.file:32s} {'ok' if ok else f'STALE: occurs {count} times{note}'}")
  print(f"{len(muts) - stale} of {len(muts)} patterns apply" + (f"; {stale} stale." if stale else "."))
  return 1 if stale else 0


def _env(dst: str) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = dst + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("NPROC", "32")  # the interpreter deadlocks on small machines without it
  env.pop("CODA_JAX_IMPL", None)
  return env


def _check_imports_from(dst: str) -> None:
  """The copy, not an installed coda-jax, must be what the tests import."""
  code = ("import coda_jax, pallas_kernels, flax_layers; "
          "print(coda_jax.__file__, pallas_kernels.__file__, flax_layers.__file__)")
  out = subprocess.run([sys.executable, "-c", code], cwd=dst, env=_env(dst),
                       capture_output=True, text=True, check=True).stdout.split()
  real = os.path.realpath(dst)
  wrong = [p for p in out if not os.path.realpath(p).startswith(real + os.sep)]
  if wrong:
    raise SystemExit(f"the copy in {dst} imports {wrong}: an installed package shadows it")


def _on_hopper() -> bool:
  """coda_jax's own test of whether kernels compile here (in a child: jax stays out of
  this process)."""
  code = "from coda_jax.epilogue_gemm import kernels_available; print(kernels_available())"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, env=_env(ROOT))
  return out.stdout.strip() == "True"


def run_one(mut: Mutation, tests_from: str | None, timeout: int, verbose: bool):
  with tempfile.TemporaryDirectory(prefix=f"mut_{mut.name}_") as dst:
    _copy_tree(dst, tests_from)
    _check_imports_from(dst)
    try:
      _plant(dst, mut)
    except SystemExit as e:  # stale text: report it and go on with the others
      return "ERROR (text not found)", 0.0, str(e)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "--no-header", *mut.tests]
    t0 = time.time()
    try:
      proc = subprocess.run(cmd, cwd=dst, env=_env(dst), capture_output=True, text=True,
                            timeout=timeout)
    except subprocess.TimeoutExpired:
      return "TIMEOUT", time.time() - t0, ""
    dt = time.time() - t0
    out = proc.stdout + proc.stderr
    if verbose:
      print(out)
    # pytest: 0 all passed, 1 some failed, 2 interrupted/collection error, 5 none ran.
    status = {0: "MISSED", 1: "CAUGHT"}.get(proc.returncode, f"ERROR (pytest {proc.returncode})")
    failed = [ln.split(" - ")[0].replace("FAILED ", "") for ln in out.splitlines()
              if ln.startswith("FAILED ")]
    return status, dt, failed[0] if failed else ""


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", help="comma-separated mutation names")
  ap.add_argument("--list", action="store_true", help="list the mutations and exit")
  ap.add_argument("--check-text", action="store_true",
                  help="only check that each mutation's old text occurs exactly once (no tests)")
  ap.add_argument("--tests-from", metavar="REV", help="use tests/ as of this git revision")
  ap.add_argument("--timeout", type=int, default=1800, help="seconds per mutation")
  ap.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
  ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
  args = ap.parse_args(argv)
  muts = MUTATIONS
  if args.only:
    names = args.only.split(",")
    unknown = sorted(set(names) - {m.name for m in MUTATIONS})
    if unknown:
      raise SystemExit(f"unknown mutations {unknown}; --list shows them")
    muts = [m for m in MUTATIONS if m.name in names]
  if args.list:
    for m in muts:
      print(f"{m.name:40s} {m.file:32s} {' '.join(m.tests)}\n    {m.why}")
    return 0
  if args.check_text:
    return _check_text(muts)
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
  except OSError:
    rev, dirty = os.environ.get("CODA_COMMIT", "?"), ""
  head = (f"library at {rev}{' + uncommitted changes' if dirty else ''}, tests "
          f"{'from ' + args.tests_from if args.tests_from else 'of the same tree'}")
  print(head, flush=True)
  rows = []
  hopper = _on_hopper()
  for i, m in enumerate(muts, 1):
    print(f"[{i}/{len(muts)}] {m.name} ...", end=" ", flush=True)
    if m.gpu_only and not hopper:
      status, dt, first = "NOT RUN (needs a Hopper GPU: the interpreter hides it)", 0.0, ""
    else:
      status, dt, first = run_one(m, args.tests_from, args.timeout, args.verbose)
    print(f"{status} in {dt:.0f} s {first}", flush=True)
    rows.append((m, status, dt, first))
  lines = [f"Planted-bug check: {head}.", "",
           "| mutation | file | result | first failing test | seconds |",
           "|---|---|---|---|---|"]
  lines += [f"| {m.name} | {m.file} | {s} | {f or '-'} | {dt:.0f} |" for m, s, dt, f in rows]
  caught = sum(s == "CAUGHT" for _, s, _, _ in rows)
  not_run = sum(s.startswith("NOT RUN") for _, s, _, _ in rows)
  lines += ["", f"{caught} of {len(rows) - not_run} caught"
            + (f"; {not_run} not run here." if not_run else ".")]
  print("\n".join(lines))
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write("\n".join(lines) + "\n")
  return 0 if caught == len(rows) - not_run else 1


if __name__ == "__main__":
  sys.exit(main())
