"""The e2e bench's trace analysis (benchmarks/e2e/trace/, breakdown.py), on hand-made input.

No GPU and no training: the attribution rule on a hand-written HLO module, the per-step
figures of hand-made kernel events (overlaps, idle time, collectives on two devices, layernorm's
busy time), the median of repeated traces, the kinds of kernel names, and the --kernels report.
"""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("flax")

from conftest import CHECKOUT  # noqa: E402

sys.path.insert(0, str(CHECKOUT))  # the checkout: benchmarks/
from benchmarks.e2e import breakdown, trace  # noqa: E402

HLO = """\
HloModule jit_train_step

%fused_computation (param_0: f32[4,8], param_1: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[4,8]{1,0} parameter(1)
  ROOT %add.1 = f32[4,8]{1,0} add(%param_0, %param_1), metadata={op_name="jit(f)/jvp(T)/e2e_layernorm/norm/add"}
}

%fused_computation.1 (param_0.1: f32[4,8]) -> f32[4,8] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  %tanh.2 = f32[4,8]{1,0} tanh(%param_0.1), metadata={op_name="jit(f)/jvp(T)/mlp/tanh"}
  ROOT %mul.3 = f32[4,8]{1,0} multiply(%tanh.2, %tanh.2), metadata={op_name="jit(f)/transpose(jvp(T))/e2e_layernorm/norm/mul"}
}

%region_0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b), metadata={op_name="jit(f)/jvp(T)/mlp/reduce_sum"}
}

%fused_computation.2 (param_0.2: f32[4,8]) -> f32[8] {
  %param_0.2 = f32[4,8]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %reduce.4 = f32[8]{0} reduce(%param_0.2, %c), dimensions={0}, to_apply=%region_0, metadata={op_name="jit(f)/transpose(jvp(T))/e2e_layernorm/norm/reduce_sum"}
}

ENTRY %main.5 (Arg_0.1: f32[4,8], Arg_1.2: f32[4,8]) -> f32[8] {
  %Arg_0.1 = f32[4,8]{1,0} parameter(0)
  %Arg_1.2 = f32[4,8]{1,0} parameter(1)
  %loop_add_fusion = f32[4,8]{1,0} fusion(%Arg_0.1, %Arg_1.2), kind=kLoop, calls=%fused_computation
  %loop_multiply_fusion.2 = f32[4,8]{1,0} fusion(%loop_add_fusion), kind=kLoop, calls=%fused_computation.1
  %custom-call.3 = f32[4,8]{1,0} custom-call(%loop_add_fusion), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/jvp(T)/mlp/dot_general"}
  ROOT %input_reduce_fusion = f32[8]{0} fusion(%loop_multiply_fusion.2), kind=kInput, calls=%fused_computation.2
}
"""


def test_attribution_rule_on_a_hand_written_module():
    classes = trace.classify_hlo(HLO)
    assert classes["loop_add_fusion"] == "ln"
    assert classes["loop_multiply_fusion_2"] == "mixed"  # tanh outside the scope, mul inside
    assert classes["custom_call_3"] == "other"
    # The reduction's shared add (to_apply) carries another op's metadata: it must not count.
    assert classes["input_reduce_fusion"] == "ln"
    a = trace.attribute
    assert a("loop_add_fusion", None, classes) == "ln"            # by kernel name
    assert a("whatever", "loop_multiply_fusion.2", classes) == "mixed"  # by hlo_op
    assert a("loop_add_fusion_1", None, classes) == "ln"          # a fusion's second kernel
    assert a("void lnbwd::kernel12<bf16>(Params)", None, classes) == "ln"  # ours, by namespace
    assert a("sm90_xmma_gemm_bf16bf16", None, classes) == "other"    # cuBLAS, by library name
    assert a("nvjet_tst_128x256_64x4", None, classes) == "other"
    assert a("loop_convert_fusion_7", None, classes) == "unmapped"  # XLA's, but no such instruction


def test_summary_counts_overlaps_once_and_the_gap_between_steps_as_the_hosts():
    classes = {"ln_k": "ln", "mix_k": "mixed", "mm": "other"}
    ns = 1e6  # 1 ms
    events = [("ln_k", None, 0, 1 * ns), ("mm", None, 0.5 * ns, 2 * ns),  # overlap: busy 0..2.5
              ("mix_k", None, 3 * ns, 1 * ns), ("fusion_9", None, 4 * ns, 2 * ns)]  # gap 2.5..3
    s = trace.summarize(events, classes, steps=2)
    assert s["kernel_ms"] == pytest.approx(3.0) and s["busy_ms"] == pytest.approx(2.75)
    # Step 2 starts at its first activity (the third of four): the gap in front of it is the
    # host's, per step boundary (one here), not idle time inside a step.
    assert s["idle_ms"] == 0 and s["between_ms"] == pytest.approx(0.5)
    assert (s["ln_ms"], s["mixed_ms"], s["other_ms"], s["unmapped_ms"]) == pytest.approx((0.5, 0.5, 1.0, 1.0))
    assert s["devices"] == 1 and s["comm_ms"] == s["overlap_ms"] == s["comm_exposed_ms"] == 0


def test_idle_is_split_by_the_kernels_around_each_gap_and_leaves_out_host_copies():
    """Each gap goes to the kind of the kernel that starts after it and of the one it follows
    (with overlaps, the one that ends last); the loss's copy to the host after the last step
    (which waits for the Python loop) is not idle time of the steps."""
    classes = {"mm": "other", "loop_add_fusion": "ln"}
    us = 1e3
    ours = "void lnbwd::kernel12<bf16>(Params)"
    events = [("gemm_a", None, 0, 10 * us), ("loop_add_fusion", None, 2 * us, 12 * us),  # ends last: 14
              (ours, None, 16 * us, 4 * us),                      # gap 14..16 before ours
              ("gemm_b", None, 21 * us, 4 * us),                  # gap 20..21 after ours
              ("Memcpy DtoH (Device -> Pinned)", None, 2025 * us, 1 * us)]  # the loss, 2 ms later
    s = trace.summarize(events, classes, steps=1, top=2)
    assert s["idle_ms"] == pytest.approx(0.003)
    assert s["idle_after"] == {"ours": [1.0, pytest.approx(0.002)], "gemm": [1.0, pytest.approx(0.001)]}
    assert s["idle_before"] == {"loop fusion": [1.0, pytest.approx(0.002)], "ours": [1.0, pytest.approx(0.001)]}
    assert s["longest_gaps"][0] == [pytest.approx(2.0), "loop fusion", "ours", "loop_add_fusion", ours]
    assert s["kernel_ms"] == pytest.approx(0.031)  # the copy's time still counts as GPU work
    assert s["gemms"] == [["gemm", "gemm_a", 1.0, pytest.approx(0.010)], ["gemm", "gemm_b", 1.0, pytest.approx(0.004)]]
    assert trace.gaps([(0, 5, "gemm", "a"), (1, 2, "ours", "b")]) == []


def test_idle_inside_steps_and_the_hosts_wait_between_them():
    """Three steps of two kernels each: the gap inside each step is idle, the gaps in front of
    steps 2 and 3 are the host's (per boundary); a lost activity (a count that is not a multiple
    of the steps) leaves every gap as idle."""
    us = 1e3
    events = []
    for k, t0 in enumerate((0, 30 * us, 100 * us)):   # steps at 0, 30 and 100 us; each 0..5, 6..10
        events += [(f"fusion_{k}a", None, t0, 5 * us), (f"fusion_{k}b", None, t0 + 6 * us, 4 * us)]
    s = trace.summarize(events, {}, steps=3)
    assert s["idle_ms"] == pytest.approx(3 * 0.001 / 3)                  # 1 us per step
    assert s["between_ms"] == pytest.approx((0.020 + 0.060) / 2)          # 30 - 10, 100 - 40
    assert s["busy_ms"] + s["idle_ms"] == pytest.approx(0.010)            # one step's GPU span
    assert [g[0] for g in s["longest_gaps"]] == [pytest.approx(1.0)] * 3  # the host's are not listed
    lost = trace.summarize(events[:-1], {}, steps=3)
    assert lost["between_ms"] == 0 and lost["idle_ms"] == pytest.approx((2 * 0.001 + 0.080) / 3)
    assert trace.step_starts([(0,), (5,), (9,), (20,)], 2) == {9} and not trace.step_starts([(0,)] * 3, 2)


def test_summary_of_two_devices_splits_collective_time_into_overlapped_and_exposed():
    """Per device: a collective's time overlapping our kernels, and not overlapping any kernel;
    a kernel on the other device never hides a collective. All figures per step per device."""
    classes = {"mm": "other", "fusion_1": "ln"}
    ns = 1e6  # 1 ms
    ours = "void lnbwd::kernel12<bf16>(Params)"
    events = [
        # device 0: an all-reduce 0..4 on stream 2; ours 1..2 and a matmul 2.5..3 on stream 1
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", None, 0, 4 * ns, 0, 2),
        (ours, None, 1 * ns, 1 * ns, 0, 1), ("mm", None, 2.5 * ns, 0.5 * ns, 0, 1),
        # device 1: an all-reduce 0..2 (by its HLO op), ours 1.5..3 (by its instruction), a fusion 3.5..4
        ("some_thunk", "all-reduce-start.3", 0, 2 * ns, 1, 7),
        ("ffi_call.5", "ffi_call.5", 1.5 * ns, 1.5 * ns, 1, 6), ("fusion_1", None, 3.5 * ns, 0.5 * ns, 1, 6),
    ]
    s = trace.summarize(events, classes, steps=1, ours=frozenset({"ffi_call_5"}))
    assert s["devices"] == 2 and s["kernels"] == 3
    assert s["comm_ms"] == pytest.approx((4 + 2) / 2)
    assert s["overlap_ms"] == pytest.approx((1 + 0.5) / 2)          # device 0: 1..2; device 1: 1.5..2
    assert s["comm_exposed_ms"] == pytest.approx((2.5 + 1.5) / 2)   # 4 - (1 + 0.5); 2 - 0.5
    assert s["busy_ms"] == pytest.approx((4 + 3.5) / 2) and s["idle_ms"] == pytest.approx((0 + 0.5) / 2)
    assert s["kernel_ms"] == pytest.approx((4 + 1 + 0.5 + 2 + 1.5 + 0.5) / 2)
    assert s["other_ms"] == pytest.approx(0.25)  # the matmul; ffi_call.5 is unmapped in this module
    # Device 0 alone, with a second collective (0..3) and a second kernel of ours (1.5..2.5) that
    # overlap the first ones: comm sums durations, overlap and exposed count each instant once.
    twice = events[:3] + [("all-gather.1", "all-gather.1", 0, 3 * ns, 0, 3), (ours, None, 1.5 * ns, 1 * ns, 0, 4)]
    s = trace.summarize(twice, classes, steps=1)
    assert s["devices"] == 1 and s["comm_ms"] == pytest.approx(4 + 3)
    assert s["overlap_ms"] == pytest.approx(1.5)        # ours 1..2.5 inside the collectives 0..4
    assert s["comm_exposed_ms"] == pytest.approx(2.0)   # 0..4 less the other kernels' 1..3


def test_collectives_and_our_calls_are_found():
    for name, op in [("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", None),
                     ("ncclKernel_ReduceScatter_RING_LL_Sum_float", None), ("thunk", "all-reduce.29"),
                     ("thunk", "all-gather-start.1"), ("thunk", "collective-permute.2"), ("t", "all-to-all.4")]:
        assert trace.attribute(name, op, {"all_reduce_29": "ln"}) == "comm", (name, op)
    assert trace.attribute("loop_broadcast_fusion", None, {"loop_broadcast_fusion": "other"}) == "other"
    hlo = ('  %ffi_call.5 = (bf16[34,64]{1,0}, f32[1,64]{1,0}) custom-call(%a, %b), '
           'custom_call_target="jax_lnbwd_layernorm_bwd_v2"\n'
           '  %custom-call.3 = f32[4,8]{1,0} custom-call(%x), custom_call_target="__cublas$gemm"\n')
    assert trace.our_calls(hlo) == {"ffi_call_5"}


def test_kinds_of_kernel_names():
    """Every kernel time has one kind, from its name (and HLO op): trace.kind's rule."""
    k = trace.kind
    for name, want in [
            ("void lnbwd::kernel12<__nv_bfloat16>(Params)", "ours"),
            ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm"),
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
            ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "gemm"),
            ("gemm_fusion_dot_3", "gemm"), ("triton_gemm_dot_1", "gemm"),
            ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128", "attention"),
            ("flash_fwd_kernel", "attention"),
            ("input_reduce_fusion_2", "reduce fusion"), ("loop_reduce_fusion", "reduce fusion"),
            ("convert_reduce_fusion.1", "reduce fusion"), ("wrapped_reduce-window", "reduce fusion"),
            ("loop_add_fusion_3", "loop fusion"), ("wrapped_transpose", "loop fusion"),
            ("fusion_12", "loop fusion"), ("triton_softmax_1", "loop fusion"),
            ("loop_copy_fusion", "loop fusion"),  # a fusion, though it copies
            ("Memcpy DtoD (Device -> Device)", "copy/memset"), ("Memset (Device)", "copy/memset"),
            ("copy_7", "copy/memset"), ("copy", "copy/memset"),
            ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "comm"),
            ("void cub::DeviceRadixSortOnesweepKernel<int>", "other"), ("redzone_checker", "other")]:
        assert k(name) == want, (name, k(name), want)
    assert k("thunk", "all-reduce-start.3") == "comm"                    # by HLO op
    assert k("ffi_call.5", "ffi_call.5", ours=frozenset({"ffi_call_5"})) == "ours"  # our custom call
    assert k("add.3", "add.3") == "other" and k("add.3", "add.3", xla=True) == "loop fusion"
    assert k("nvjet_tst_128x256", "custom-call.3", xla=True) == "gemm"  # the library's name wins


def test_summary_splits_all_kernel_time_into_kinds():
    classes = {"loop_add_fusion": "ln", "input_reduce_fusion": "other", "loop_mul_fusion": "other",
               "loop_gelu_fusion": "mixed"}
    ns = 1e6
    events = [("void lnbwd::k<f32>", None, 0, 1 * ns), ("nvjet_tst_64x8", None, 1 * ns, 4 * ns),
              ("input_reduce_fusion", None, 5 * ns, 2 * ns), ("loop_mul_fusion", None, 7 * ns, 1 * ns),
              ("loop_mul_fusion", None, 8 * ns, 1 * ns), ("loop_add_fusion", None, 9 * ns, 1 * ns),
              ("loop_gelu_fusion", None, 10 * ns, 1 * ns), ("Memset (Device)", None, 11 * ns, 1 * ns),
              ("mystery_kernel", None, 12 * ns, 2 * ns)]
    s = trace.summarize(events, classes, steps=2, top=5)
    assert s["kinds"] == pytest.approx({"ours": 0.5, "gemm": 2.0, "attention": 0.0, "reduce fusion": 1.0,
                                        "loop fusion": 2.0, "copy/memset": 0.5, "comm": 0.0, "other": 1.0})
    assert sum(s["kinds"].values()) == pytest.approx(s["kernel_ms"])
    # The other class's XLA fusions, costliest first; ln and mixed kernels stay in "top"
    assert s["top_other"] == [["reduce fusion", "input_reduce_fusion", 0.5, pytest.approx(1.0)],
                              ["loop fusion", "loop_mul_fusion", 1.0, pytest.approx(1.0)]]
    assert {t[1] for t in s["top"]} == {"void lnbwd::k<f32>", "loop_add_fusion", "loop_gelu_fusion"}
    assert "top_other" not in trace.summarize(events, classes, steps=2)


def _row(variant, kinds, idle=0.0, baseline=False, top_other=()):
    return {"model": "gpt", "api": "linen", "dtype": "bfloat16", "variant": variant, "baseline": baseline,
            "trace": {"kinds": dict.fromkeys(trace.KINDS, 0.0) | kinds, "idle_ms": idle,
                      "top": [["ln", "loop_add_fusion", 13.0, 0.25]], "top_other": list(top_other)}}


def test_the_kernels_report_prints_each_variants_change_by_kind():
    base = _row("flax", {"gemm": 20.0, "loop fusion": 5.0, "reduce fusion": 2.0}, idle=1.0, baseline=True)
    ours = _row("add_layernorm", {"gemm": 20.01, "loop fusion": 5.31, "reduce fusion": 1.45, "ours": 0.74},
                idle=0.9, top_other=[["loop fusion", "loop_multiply_fusion_4", 6.0, 1.5]])
    line = breakdown.diff_line(ours, base)
    assert line == ("gpt linen bfloat16 add_layernorm vs flax: kernel +0.510 ms per step: "
                    "ours +0.740, reduce fusion -0.550, loop fusion +0.310, gemm +0.010; idle -0.100")
    other = dict(ours, model="bert")  # no baseline of its own: no difference printed
    untraced = dict(base, variant="jax_lnbwd", baseline=False, trace=None)
    text = breakdown.text([base, ours, other, untraced], 3)
    assert text.count(" vs flax: ") == 1 and line in text
    assert "gpt linen bfloat16 flax: kernel ms per step by kind: gemm 20.000, loop fusion 5.000" in text
    assert "loop_multiply_fusion_4" in text and "jax_lnbwd" not in text
    assert breakdown.text([base], 3).count("against the baseline") == 0
    base["trace"]["gemms"] = [["gemm", "nvjet_sm90_tst_320x64_64x4_1x2_h_bz_TNT", 12.0, 0.9],
                              ["gemm", "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 6.0, 0.3]]
    ours["trace"]["gemms"] = [["gemm", "nvjet_sm90_tst_320x64_64x4_1x2_h_bz_TNT", 6.0, 0.45],
                              ["gemm", "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_TNT", 6.0, 0.6],
                              ["gemm", "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 6.0, 0.3]]
    assert breakdown.gemm_lines(ours, base, 3) == [
        "  +0.600 ms  launches 0.0 -> 6.0  nvjet_sm90_tst_256x128_64x4_2x1_v_bz_TNT",
        "  -0.450 ms  launches 12.0 -> 6.0  nvjet_sm90_tst_320x64_64x4_1x2_h_bz_TNT"]  # unchanged ones left out
    assert "matmul kernels against the baseline" in breakdown.text([base, ours], 3)
    # XLA's Triton gemm fusions are numbered per compiled step: compared without the number
    base["trace"]["gemms"] = [["gemm", "gemm_fusion_dot_227", 6.0, 1.288], ["gemm", "gemm_fusion_dot_228", 6.0, 1.301],
                              ["gemm", "sm90_xmma_gemm_bf16bf16_tilesize128x128x64", 6.0, 0.5]]
    ours["trace"]["gemms"] = [["gemm", "gemm_fusion_dot_239", 6.0, 1.297], ["gemm", "gemm_fusion_dot_240", 6.0, 1.306],
                              ["gemm", "sm90_xmma_gemm_bf16bf16_tilesize128x128x64", 6.0, 0.5]]
    assert breakdown.gemm_lines(ours, base, 3) == ["  +0.014 ms  launches 12.0 -> 12.0  gemm_fusion_dot"]
    base["trace"]["idle_after"] = {"gemm": [80.0, 0.2], "copy/memset": [80.0, 0.35]}
    ours["trace"]["idle_after"] = {"gemm": [80.0, 0.2], "copy/memset": [80.0, 0.33], "ours": [26.0, 0.04]}
    assert breakdown.idle_line(ours, base) == ("ours +26.0 gaps +0.040, copy/memset +0.0 gaps -0.020, "
                                               "gemm +0.0 gaps +0.000")
    assert "by the kernel after each gap: copy/memset 80.0 gaps 0.350, gemm 80.0 gaps 0.200" in \
        breakdown.text([base, ours], 3)


def test_layernorm_time_counts_overlapping_kernels_once():
    """Our finalize kernel starts early and waits for the main kernel (programmatic dependent
    launch): its interval covers the main kernel's. ln_busy counts that time once, ln sums it."""
    classes = {"mix_k": "mixed", "mm": "other"}
    ns = 1e6
    events = [("void lnbwd::kernel12_ring<bf16>", None, 0, 2 * ns),
              ("void lnbwd::finalize_partials<bf16>", None, 0.5 * ns, 2 * ns),   # 0.5..2.5
              ("mm", None, 2.5 * ns, 1 * ns), ("mix_k", None, 3 * ns, 1 * ns)]  # mixed 3..4 beside mm
    s = trace.summarize(events, classes, steps=1)
    assert s["ln_ms"] == pytest.approx(4.0) and s["ln_busy_ms"] == pytest.approx(2.5)
    assert s["mixed_ms"] == pytest.approx(1.0) and s["ln_mixed_busy_ms"] == pytest.approx(3.5)
    assert s["busy_ms"] == pytest.approx(4.0) and s["idle_ms"] == 0


def test_of_repeated_traces_the_median_step_counts():
    def summary(busy, idle):
        return {"busy_ms": busy, "idle_ms": idle, "ln_ms": busy / 10}
    got = trace.median_summary([summary(40.0, 120.0), summary(40.0, 1.0), {}, summary(40.5, 1.2)])
    assert got["idle_ms"] == 1.2 and got["repeats"] == 3  # the host pause (idle 120) is left out
    assert got["spans_ms"] == pytest.approx([41.0, 41.7, 160.0])
    assert trace.median_summary([{}, {}]) == {}


def test_traces_are_interleaved_like_the_rounds():
    from benchmarks.e2e.cli import interleaved
    got = [(rep, run) for rep, run in interleaved(["flax", "drop-in", "fused"], 3)]
    assert got == [(0, "flax"), (0, "drop-in"), (0, "fused"), (1, "fused"), (1, "drop-in"), (1, "flax"),
                   (2, "flax"), (2, "drop-in"), (2, "fused")]
    assert interleaved(["flax"], 2) == [(0, "flax"), (1, "flax")]


QK_HLO = """\
HloModule jit_train_step

%fused_computation.7 (param_0.7: bf16[4,2,8]) -> bf16[4,2,8] {
  %param_0.7 = bf16[4,2,8]{2,1,0} parameter(0)
  ROOT %mul.7 = bf16[4,2,8]{2,1,0} multiply(%param_0.7, %param_0.7), metadata={op_name="jit(f)/jvp(T)/e2e_qk_norm/q_norm/mul"}
}

%fused_computation.8 (param_0.8: bf16[4,2,8]) -> bf16[4,2,8] {
  %param_0.8 = bf16[4,2,8]{2,1,0} parameter(0)
  %cos.8 = bf16[4,2,8]{2,1,0} cosine(%param_0.8), metadata={op_name="jit(f)/jvp(T)/attn/rope/cos"}
  ROOT %mul.8 = bf16[4,2,8]{2,1,0} multiply(%cos.8, %param_0.8), metadata={op_name="jit(f)/jvp(T)/e2e_qk_norm/k_norm/mul"}
}

ENTRY %main.9 (Arg_0.1: bf16[4,2,8]) -> bf16[4,2,8] {
  %Arg_0.1 = bf16[4,2,8]{2,1,0} parameter(0)
  %loop_multiply_fusion = bf16[4,2,8]{2,1,0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation.7
  %loop_cosine_fusion = bf16[4,2,8]{2,1,0} fusion(%loop_multiply_fusion), kind=kLoop, calls=%fused_computation.8
  ROOT %custom-call.4 = bf16[4,2,8]{2,1,0} custom-call(%loop_cosine_fusion), custom_call_target="jax_lnbwd_rmsnorm_bwd_v2", metadata={op_name="jit(f)/transpose(jvp(T))/e2e_qk_norm/qk_norm/ffi_call"}
}
"""


def test_the_qk_norm_has_its_own_figures_and_our_kernels_go_to_it_where_they_serve_only_it():
    """--qk-norm: the QK-norm's classes come from its own scope, and our kernels found by name
    count for it (not for layernorm) where every custom call of ours is under that scope."""
    assert trace.our_scope(QK_HLO) == "qk" and trace.our_scope(HLO) == "ln"
    qk_classes = trace.classify_hlo(QK_HLO, "e2e_qk_norm")
    assert qk_classes["loop_multiply_fusion"] == "ln" and qk_classes["loop_cosine_fusion"] == "mixed"
    ns = 1e6  # 1 ms
    events = [("loop_multiply_fusion", None, 0, 1 * ns), ("loop_cosine_fusion", None, 1 * ns, 2 * ns),
              ("void lnbwd::kernel11_rows<bf16>(Params)", None, 3 * ns, 0.5 * ns)]
    s = trace.summarize(events, trace.classify_hlo(QK_HLO), steps=1, qk_classes=qk_classes, ours_scope="qk")
    assert s["qk_busy_ms"] == pytest.approx(1.5) and s["qk_mixed_busy_ms"] == pytest.approx(3.5)
    assert s["ln_busy_ms"] == 0 and s["ln_ms"] == 0
    # Our kernels serving layernorm (our_scope "ln") stay layernorm's and are not the QK-norm's.
    s = trace.summarize(events, trace.classify_hlo(QK_HLO), steps=1, qk_classes=qk_classes)
    assert s["qk_busy_ms"] == pytest.approx(1.0) and s["ln_busy_ms"] == pytest.approx(0.5)
    # A module without QK-norm work has no QK figures.
    assert "qk_busy_ms" not in trace.summarize(events, {}, steps=1, qk_classes=trace.classify_hlo(HLO, "e2e_qk_norm"))


def test_the_table_shows_the_qk_norm_columns_only_where_a_trace_has_them():
    from benchmarks.e2e import report

    row = {"model": "public_llama", "api": "linen", "dtype": "bfloat16", "variant": "qk_flax", "norm": "rmsnorm",
           "baseline": True, "ms": 10.0, "spread_pct": 1.0, "speedup": 1.0, "speedup_min": 1.0, "speedup_max": 1.0,
           "loss_last": 0.5,
           "trace": {"ln_busy_ms": 0.1, "ln_mixed_busy_ms": 0.2, "ln_ms": 0.1, "mixed_ms": 0.1, "kernel_ms": 9.0,
                     "idle_ms": 0.3, "between_ms": 0.0, "unmapped_ms": 0.0}}
    plain = report.format_table([row])
    assert " qk " not in plain.splitlines()[0] and "qk, +qmix" not in report.columns(False, [row])
    qk_row = {**row, "trace": {**row["trace"], "qk_busy_ms": 0.25, "qk_mixed_busy_ms": 0.75}}
    head, _, cells = report.format_table([qk_row]).splitlines()
    assert head.split()[9:11] == ["qk", "+qmix"] and cells.split()[9:11] == ["0.250", "0.750"]
    assert "qk, +qmix" in report.columns(False, [qk_row])
