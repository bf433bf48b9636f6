"""The cost report of the fused kernels' machine code (``python -m gpu_tools.kernel_cost``): its
FlashAttention-2-style baseline against explicit attention (under Triton's interpreter, as conftest.py sets it
without a GPU), the SASS reading and the throughput model on a fixed piece of SASS with figures worked by hand, the
launches recorded for each case, and one compilation for sm_90 in a process of its own (Triton's compiler, not its
interpreter)."""

import json
import math
import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from conftest import run  # noqa: E402
from gpu_tools import flash_reference, kernel_cost, sass, throughput  # noqa: E402
from kerple_core.attention import fused  # noqa: E402
from kerple_core.attention.fused import Tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dropout, forward_tiles, backward_tiles", [
    (0.0, Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)),
    (0.3, Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)),
    (0.3, Tiles(32, 16, 4, 1), Tiles(16, 32, 4, 1)),
])
def test_the_baseline_equals_explicit_causal_attention(dropout, forward_tiles, backward_tiles):
    """Outputs and the gradients of queries, keys and values, float32, 64 tokens in square tiles of 16 (the
    diagonal's and the others), and in tiles of 32 rows for each program (two tiles on the diagonal); with dropout,
    the cells the fused kernels' stream keeps."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    grad = torch.randn(1, 2, 64, 16, generator=g).to(DEVICE)
    out = flash_reference.attention(q, k, v, dropout, 7, forward_tiles, backward_tiles)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    scores = (q @ k.transpose(-1, -2)) * 16 ** -0.5
    future = torch.ones(64, 64, dtype=torch.bool, device=DEVICE).triu(1)
    probabilities = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
    if dropout:
        keep = fused.keep_mask(2, 64, 64, dropout, 7, DEVICE).view(1, 2, 64, 64)
        probabilities = probabilities * keep / fused.keep_probability(dropout)
    expected = probabilities @ v
    for a, b in zip(got, (expected, *torch.autograd.grad(expected, (q, k, v), grad))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_baseline_refuses_a_length_that_is_not_whole_tiles():
    q = torch.zeros(1, 1, 48, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 32"):
        flash_reference.attention(q, q, q, forward_tiles=Tiles(16, 16, 4, 1), backward_tiles=Tiles(16, 32, 4, 1))


# a masked loop (17 instructions) and the same tile without masks (14), as nvdisasm -c prints them
SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0020*/                   ISETP.GE.AND P1, PT, R0, R2, PT ;
        /*0030*/                   FSEL R8, R8, -INF , P1 ;
        /*0040*/                   LDS.128 R20, [R3] ;
        /*0050*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0060*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0070*/                   FFMA R12, R8, R9, R10 ;
        /*0080*/                   IMAD.MOV.U32 R13, RZ, RZ, R12 ;
        /*0090*/                   IMAD.WIDE R14, R13, 0x4, R2 ;
        /*00a0*/                   IMAD.HI.U32 R16, R13, R12, RZ ;
        /*00b0*/                   LOP3.LUT R17, R13, 0xff, RZ, 0xc0, !PT ;
        /*00c0*/                   F2FP.F16.F32.PACK_AB R18, R17, R16 ;
        /*00d0*/                   MUFU.EX2 R19, R14 ;
        /*00e0*/                   STS.128 [R3], R8 ;
        /*00f0*/                   SHFL.BFLY PT, R20, R19, 0x1, 0x1f ;
        /*0100*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*0110*/                   FROB R21, R20 ;
        /*0120*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0130*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0140*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0150*/                   FFMA R12, R8, R9, R10 ;
        /*0160*/                   IMAD.MOV.U32 R13, RZ, RZ, R12 ;
        /*0170*/                   IMAD.WIDE R14, R13, 0x4, R2 ;
        /*0180*/                   IMAD.HI.U32 R16, R13, R12, RZ ;
        /*0190*/                   LOP3.LUT R17, R13, 0xff, RZ, 0xc0, !PT ;
        /*01a0*/                   F2FP.F16.F32.PACK_AB R18, R17, R16 ;
        /*01b0*/                   MUFU.EX2 R19, R14 ;
        /*01c0*/                   STS.128 [R3], R8 ;
        /*01d0*/                   SHFL.BFLY PT, R20, R19, 0x1, 0x1f ;
        /*01e0*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*01f0*/                   FROB R21, R20 ;
        /*0200*/               @P1 BRA `(.L_x_1) ;
        /*0210*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0220*/                   EXIT ;
.L_x_3:
        /*0230*/                   BRA `(.L_x_3);
        /*0240*/                   NOP;
"""


def test_the_sass_is_read_into_instructions_and_loops():
    instructions = sass.parse(SASS)
    assert len(instructions) == 37
    assert instructions[0] == sass.Instruction(0, "LDC", "R1, c[0x0][0x28]", None)
    assert [(i.address, i.opcode, i.target) for i in instructions if i.target is not None] == [
        (0x120, "BRA", 0x20), (0x200, "BRA", 0x130), (0x210, "BRA", 0x220), (0x230, "BRA", 0x230)]
    assert instructions[-1].opcode == "NOP"
    loops = sass.loops(instructions)
    assert [(loop.start, loop.end, len(loop.body)) for loop in loops] == [(0x20, 0x120, 17), (0x130, 0x200, 14),
                                                                          (0x230, 0x230, 1)]
    outer = sass.Loop(0x20, 0x200, instructions[2:33])
    assert sass.innermost([outer, *loops]) == loops
    assert sass.opcode_counts(loops[1].body)["IMAD.MOV.U32"] == 1


def test_the_opcodes_classes_flop_and_shared_memory_traffic():
    assert [throughput.classify(op) for op in ("HGMMA.64x64x16.F32", "IMAD.MOV.U32", "HFMA2.MMA", "VIADD",
                                               "F2FP.BF16.F32.PACK_AB", "MUFU.EX2", "I2F.U32", "LDGSTS.E.BYPASS.128",
                                               "REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU", "WARPGROUP.ARRIVE", "ULDC.64",
                                               "FROB")] == [
        "tensor", "fma", "fma", "alu", "alu", "sfu", "sfu", "memory", "memory", "other", "other", "unknown"]
    assert throughput.tensor_flops("HMMA.16816.F32") == 16 * 8 * 16 * 2
    assert throughput.tensor_flops("HMMA.1688.F32.TF32") == 16 * 8 * 8 * 2
    assert throughput.tensor_flops("HGMMA.64x128x16.F32") == 64 * 128 * 16 * 2 // 4  # a warp's quarter
    assert [throughput.data_path_clocks(op) for op in ("LDSM.16.MT88.4", "LDSM.16.M88.2", "LDS", "LDS.64",
                                                       "STS.128", "LDG.E.U16", "REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU",
                                                       "SHFL.BFLY", "LDC")] == [4, 2, 1, 2, 4, 1, 4, 1, 0]


def test_the_model_costs_a_loop_by_its_binding_bound():
    """The unmasked loop of :data:`SASS` by 4 warps, one a sub-partition: 14 instructions; FMA: 3 IMAD (the heavy
    half, 2 clocks each) and 1 FFMA; 2 ALU; 1 MUFU; one HMMA.16816 a warp; shared memory: LDSM x4 (4 clocks),
    STS.128 (4), SHFL (1) a warp."""
    main = sass.loops(sass.parse(SASS))[1]
    h100 = throughput.loop_cost(main.body, 4, 64 * 64, throughput.SMS[90])
    assert h100.instructions == 14
    assert h100.classes == dict(tensor=1, fma=4, alu=2, sfu=1, memory=3, other=2, unknown=1)
    assert h100.flops == 4 * 4096
    assert h100.bounds == dict(issue=14, fma=max(6, (6 + 2) / 2), alu=4, sfu=8, tensor=4, shared=36)
    assert (h100.binding, h100.clocks, h100.per_cell) == ("shared", 36, 36 / 4096)
    a100 = throughput.loop_cost(main.body, 4, 64 * 64, throughput.SMS[80])
    assert (a100.bounds["fma"], a100.bounds["tensor"], a100.binding) == (6 + 2, 8, "shared")
    assert throughput.unknown_opcodes(main.body) == ["FROB"]
    exponentials = sass.parse("/*0000*/ MUFU.EX2 R1, R2 ;\n/*0010*/ MUFU.EX2 R3, R4 ;\n/*0020*/ FFMA R5, R1, R3, R5 ;")
    sfu = throughput.loop_cost(exponentials, 8, 16, throughput.SMS[90])
    assert (sfu.binding, sfu.clocks, sfu.per_cell) == ("sfu", 2 * 8 * 2, 2.0)


# Triton's GPU IR of a masked loop (5 operations), a loop whose dot is under an scf.if (4), and a loop without a dot
TTGIR = """
module attributes {"ttg.num-warps" = 4 : i32} {
  tt.func public @kernel(%arg0: !tt.ptr<f16> {tt.divisibility = 16 : i32}) attributes {noinline = false} {
    %0 = arith.constant 0 : i32
    %1:2 = scf.for %i = %0 to %n step %c64 iter_args(%a = %x, %b = %y) -> (tensor<64x64xf32>, i32) : i32 {
      %2 = arith.cmpi sge, %t, %s : tensor<64x64xi32>
      %3 = arith.select %2, %a, %cst : tensor<64x64xi1>, tensor<64x64xf32>
      %4 = arith.addi %b, %c1 : i32
      %5 = tt.dot %q, %k, %3 : tensor<64x64xf16> * tensor<64x64xf16> -> tensor<64x64xf32>
      scf.yield %5, %4 : tensor<64x64xf32>, i32
    } loc(#loc1)
    %6:2 = scf.for %i = %0 to %n step %c64 iter_args(%a = %1#0, %b = %1#1) -> (tensor<64x64xf32>, i32) : i32 {
      %7 = scf.if %p -> (tensor<64x64xf32>) {
        %8 = ttng.warp_group_dot %q, %k, %a {isAsync = true} : !ttg.memdesc<64x64xf16> * !ttg.memdesc<64x64xf16>
        scf.yield %8 : tensor<64x64xf32>
      } else {
        scf.yield %a : tensor<64x64xf32>
      }
      scf.yield %7, %b : tensor<64x64xf32>, i32
    }
    %9 = scf.for %j = %0 to %n step %c1 iter_args(%c = %0) -> (i32) : i32 {
      %10 = arith.addi %c, %c1 : i32
      scf.yield %10 : i32
    }
    tt.return
  }
}
"""


def test_the_main_loop_is_the_loop_of_fewest_operations_in_tritons_ir():
    """The unmasked loop has the fewest operations in the IR (the SASS's counts are the fallback, where the IR's
    loops do not match its own); the causal cost weighs the diagonal's tiles by the masked loops' mean."""
    assert kernel_cost.dot_loop_sizes(TTGIR) == [5, 4]
    loops, costs = kernel_cost.tensor_loops(sass.parse(SASS), Tiles(64, 64, 4, 3), 90)
    assert [len(loop.body) for loop in loops] == [17, 14]
    assert [cost.clocks for cost in costs] == [52, 36]  # the masked loop's LDS.128 adds 4 clocks a warp
    assert kernel_cost.main_loop(costs, [5, 4]) == (1, "ir")
    assert kernel_cost.main_loop(costs, [4, 5]) == (0, "ir")
    assert kernel_cost.main_loop(costs, [4]) == (1, "sass")
    # 32 tiles a side at 2048 tokens: 32 on the diagonal at 52 clocks, 496 wholly seen at 36
    assert kernel_cost.causal_per_cell(36, [52], 64, 64) == pytest.approx((32 * 52 + 496 * 36) / (528 * 64 * 64))
    # 128 tokens in 32 x 64 tiles: queries 64-95 and 96-127 see keys 0-63 whole; 4 tiles crossed, 2 in the future
    assert kernel_cost.causal_per_cell(10, [20, 30], 32, 64, 128) == pytest.approx((4 * 25 + 2 * 10) / (6 * 32 * 64))


def test_the_cases_record_the_launches_they_name():
    """ALiBi's bias is computed from its slopes, KERPLE-log's read from its table, with a per-distance gradient in the
    backward; FoX adds gates to a zero (linear) bias, the weight kernel a weight table; dropout is on; the
    interpreter's flag is off."""
    launches = {key: kernel_cost.fused_launches(case, torch.float16, 64, 0.1)
                for key, case in kernel_cost.CASES.items()}
    for recorded in launches.values():
        assert [direction for direction, _ in recorded] == ["forward", "backward"]
        assert all(launch.constants["HAS_DROPOUT"] and not launch.constants["UPCAST"] for _, launch in recorded)
    (_, alibi), (_, alibi_back) = launches["alibi"]
    (_, kerple), (_, kerple_back) = launches["kerple_log"]
    assert alibi.name == kerple.name and {**alibi.constants, "LINEAR": False} == kerple.constants
    assert (alibi.constants["LINEAR"], alibi_back.constants["LINEAR"], kerple_back.constants["LINEAR"]) == (
        True, True, False)
    assert launches["fox"][0][1].constants["LINEAR"] and not launches["weight"][0][1].constants["LINEAR"]
    assert (alibi_back.constants["BIAS_GRAD"], kerple_back.constants["BIAS_GRAD"]) == (False, True)
    assert launches["fox"][1][1].constants["HAS_GATES"] and not launches["fox"][1][1].constants["BIAS_GRAD"]
    assert launches["weight"][0][1].constants["HAS_WEIGHT"] and launches["weight"][1][1].constants["BIAS_GRAD"]
    baseline = kernel_cost.baseline_launches(torch.float16, 64, 0.1)
    assert [(direction, launch.name) for direction, launch in baseline] == [("forward", "flash_forward"),
                                                                            ("backward", "flash_backward")]


def test_a_cases_floor_is_the_work_its_bias_adds_to_a_cell():
    """The floor's own work a cell: the bias's add, a 4-byte table load unless the bias is linear (and the weight's),
    and in the backward each cell added into its distance's sum, the weight's product and sum, the gates' row and
    column sums."""
    work = kernel_cost.own_work
    cases = kernel_cost.CASES
    assert work(cases["alibi"], "forward") == work(cases["alibi"], "backward") == {"FADD": 1}
    assert work(cases["kerple_log"], "forward") == {"FADD": 1, "LDG.E": 1}
    assert work(cases["kerple_log"], "backward") == {"FADD": 2, "LDG.E": 1}
    assert work(cases["fox"], "forward") == {"FADD": 1} and work(cases["fox"], "backward") == {"FADD": 3}
    assert work(cases["weight"], "forward") == {"FADD": 1, "LDG.E": 2}
    assert work(cases["weight"], "backward") == {"FADD": 2, "LDG.E": 2, "FMUL": 1, "FFMA": 1}


@pytest.mark.slow
@pytest.mark.cross_compile
def test_the_report_compiles_the_baseline_and_the_fused_forward_for_sm_90(tmp_path):
    """The smallest report: both forwards at heads of 64 for sm_90, compiled by Triton's compiler in a process of
    its own; each has registers, a main loop of tensor-core instructions doing a tile's two products, and finite
    positive costs."""
    out = tmp_path / "cost.json"
    proc = run([sys.executable, "-m", "gpu_tools.kernel_cost", "--arch", "90", "--head-dims", "64", "--cases",
                "alibi", "--directions", "forward", "--json", out], env={**os.environ, "TRITON_INTERPRET": "0"})
    rows = json.loads(out.read_text())["results"][0]["rows"]
    assert [(row["case"], row["kernel"]) for row in rows] == [("FA2-style", "flash_forward"),
                                                                ("ALiBi", "forward_kernel")]
    for row in rows:
        loop, tiles = row["loops"][row["main"]], row["tiles"]
        assert row["registers"] > 0 and loop["classes"]["tensor"] > 0 and row["main_chosen_by"] == "ir"
        assert loop["flops"] == 2 * (2 * tiles["block_m"] * tiles["block_n"] * 64)  # q k^T and p v of one tile
        for figure in (row["per_cell"], row["causal_per_cell"], row["ratio"], row["causal_ratio"]):
            assert math.isfinite(figure) and figure > 0
    assert rows[0]["ratio"] == 1.0 and "floor" not in rows[0]
    floor = rows[1]["floor"]["causal_per_cell"]  # the baseline and a cell's added FADD: no less than the baseline
    assert floor >= rows[0]["causal_per_cell"] and rows[1]["floor_ratio"] >= 1.0
    assert rows[1]["over_floor"] == pytest.approx(rows[1]["causal_per_cell"] / floor)
    assert "| forward (forward_kernel) | ALiBi |" in proc.stdout
