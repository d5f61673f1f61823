"""The plan's report: the analytic figures, XLA's beside them, and the gap (one formatter).

:func:`format_report` renders what :func:`tpu_train.planning.command.run_plan` returns (an
analytic estimate, optionally with an ``xla`` analysis and a ``verdict``); ``tpu-train plan``
prints it and writes every figure to a JSON file.
"""

from __future__ import annotations

from typing import Any

from .estimate import HEADROOM, GiB

__all__ = ["format_bytes", "format_fitting", "format_report"]

_MEMORY_ROWS = ("params", "grads", "optimizer", "grad_accumulator", "fsdp_gathered",
                "stacked_layers", "activations", "loss_head", "context_kv", "total")


def format_bytes(n: float) -> str:
    return f"{n / GiB:8.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:8.2f} MiB"


def _setting_line(result: dict[str, Any]) -> str:
    m = result["mesh"]
    expert = f" expert={m['expert']}" if m.get("expert", 1) > 1 else ""
    context = f" context={m['context']}" if m.get("context", 1) > 1 else ""
    return (f"mesh data={m['data']} fsdp={m['fsdp']}{expert} tensor={m['tensor']}{context} "
            f"({result['num_devices']} chips), batch {result['batch']} x seq "
            f"{result['seq_len']}, remat {result.get('remat', 'none')}, activations "
            f"{8 * result['activation_bytes_per_element']}-bit, attention scores "
            f"{_scores(result)}"
            + (", layers scanned" if result.get("scan_layers") else ""))


def _scores(result: dict[str, Any]) -> str:
    if result["mesh"].get("context", 1) > 1:
        return "not kept (context parallel: per shard, the kernels on a TPU, else blockwise)"
    return "not kept (fused kernel)" if result["flash_attention"] else "materialized"


def _chip_line(result: dict[str, Any]) -> str:
    return (f"on {result['chip']} ({format_bytes(result['chip_hbm_bytes']).strip()} HBM, "
            f"{result['chip_bf16_tflops']:.0f} bf16 TFLOP/s) at an assumed MFU of "
            f"{100 * result['assumed_mfu']:.0f} %: step {result['step_time_s']:.3f} s, "
            f"{result['tokens_per_s_per_chip']:,.0f} tokens/s/chip")


def _xla_lines(result: dict[str, Any]) -> list[str]:
    x = result["xla"]
    if "bytes_peak_estimate" not in x:
        reason = x.get("out_of_memory") or x.get("xla_error", "no figures")
        return [f"XLA analysis unavailable: {reason}"]
    where = x.get("compiled_for") or f"{result['num_devices']} virtual CPU devices"
    early = "compile_until_buffer_assignment" in x.get("seconds", {})
    if early:
        where += ", at its buffer assignment"
    flops = (f", {x['flops_per_device']:.3e} FLOPs per chip" if x.get("flops_per_device")
             else "")
    lines = [f"XLA ({x.get('compiler', 'CPU')} compiler, {where}): "
             f"{x['bytes_peak_estimate'] / GiB:.2f} GiB per chip (arguments "
             f"{x['argument_size_in_bytes'] / GiB:.2f}, temporaries "
             f"{x['temp_size_in_bytes'] / GiB:.2f} GiB){flops}"]
    if "out_of_memory" in x:
        lines.append(f"  the compile stopped: {x['out_of_memory']}")
    if early:
        lines.append("  memory: read before code generation, a lower bound (the compiler's own "
                     "total was 3-7 % more for Llama-3.1-8B and 70B); plan.fast=false compiles "
                     "the executable for its figure")
    if x.get("compiler_total_hbm_bytes"):
        reserved = x.get("compiler_reserved_hbm_bytes", 0)
        lines.append(f"  memory: {(x['compiler_total_hbm_bytes'] - reserved) / GiB:.2f} GiB per "
                     f"chip by the compiler's own total (its log: "
                     f"{x['compiler_total_hbm_bytes'] / GiB:.2f} GiB with the runtime's "
                     f"{reserved / GiB:.2f} reserved), compared below; memory_analysis() above "
                     "counts the temporaries' fragmentation twice")
    if x.get("flops_note"):
        lines.append(f"  FLOPs: {x['flops_note']}")
    lines += _step_time_lines(x)
    gap = f"XLA vs analytic per chip: memory {100 * result['xla_vs_analytic']:+.1f} %"
    if "xla_flops_vs_analytic" in result:
        gap += f", FLOPs {100 * result['xla_flops_vs_analytic']:+.1f} %"
    return lines + [gap]


def _step_time_lines(x: dict[str, Any]) -> list[str]:
    """The step time predicted from the compiled program, where it goes, and its basis."""
    if x.get("step_time_error"):
        return [f"  step time: not predicted ({x['step_time_error']})"]
    p = x.get("step_time")
    if not p:
        return []
    ms = lambda s: f"{1e3 * s:.1f} ms"  # noqa: E731
    head = f"step time predicted from the compiled program: {ms(p['step_time_s'])}"
    if "mfu" in p:
        head += (f", MFU {100 * p['mfu']:.1f} %, "
                 f"{p['tokens_per_s_per_chip']:,.0f} tokens/s/chip")
    comms = ""
    if p["ici_bytes_per_chip"] or p["dcn_bytes_per_chip"]:
        comms = (f"; per chip a step sends {p['ici_bytes_per_chip'] / 1e6:,.1f} MB over ICI, "
                 f"{p['dcn_bytes_per_chip'] / 1e6:,.1f} MB over DCN")
    lines = [head,
             f"  where it goes: compute-bound kernels {ms(p['compute_bound_s'])}, memory-bound "
             f"{ms(p['memory_bound_s'])}, vector-bound {ms(p['vector_bound_s'])}, exposed "
             f"copies {ms(p['exposed_copy_s'])}, exposed collectives ICI "
             f"{ms(p['exposed_ici_s'])} DCN {ms(p['exposed_dcn_s'])}{comms}"]
    links = p.get("collectives_by_link") or {}
    if links.get("dcn"):
        named = {link: ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items()))
                 for link, kinds in links.items()}
        lines.append(f"  across slices (DCN): {named['dcn']}; inside a slice (ICI): "
                     f"{named.get('ici') or 'none'}")
    costliest = ", ".join(f"{k['op']} ({k['bound']}, {k['runs']} runs) {ms(k['seconds'])}"
                          for k in p["top_kernels"][:4])
    lines.append(f"  costliest kernels: {costliest}")
    lines.append(f"  basis: each kernel the longest of its FLOPs, HBM bytes and the compiler's "
                 f"cycle estimate, transfers overlapped as scheduled; {p['basis']}")
    return lines


def _verdict_lines(result: dict[str, Any]) -> list[str]:
    """The one verdict, its figure and basis, and the settings that would fit."""
    v = result.get("verdict")
    if v is None:
        return ["verdict: none without a chip (plan.chip=v5e, v5p, v6e, ...)"]
    lines = [f"verdict: {'FITS' if v['fits'] else 'DOES NOT FIT'} on {result['chip']}: "
             f"{format_bytes(v['needed_bytes']).strip()} per chip of "
             f"{format_bytes(v['usable_bytes']).strip()} usable "
             f"({format_bytes(result['chip_hbm_bytes']).strip()} HBM less "
             f"{100 * HEADROOM:.0f} % headroom), by {v['basis']}"]
    return lines


def format_fitting(result: dict[str, Any]) -> str:
    """The settings that would fit a plan that does not (``result["fitting"]``): those XLA's
    compile confirmed, then those only estimated; or why none was found."""
    v = result.get("verdict")
    if v is None or v["fits"]:
        return ""
    fitting = [f for f in result.get("fitting") or [] if f.get("checked") is not False]
    if not fitting:
        return ("  no setting the planner tried fits (trainer.remat, trainer.micro_batch_size, "
                "parallel.tensor, up to 4x the chips): shorten data.seq_len or take a chip "
                "with more HBM")
    lines = ["  settings that would fit:"]
    for f in fitting:
        chips = (f", {f['num_devices']} chips" if f["num_devices"] != result["num_devices"]
                 else "")
        if f.get("checked"):
            how = f"XLA: fits, {format_bytes(f['checked_bytes']).strip()} per chip{chips}"
            if "checked_mfu" in f:
                how += (f", step {1e3 * f['checked_step_time_s']:.1f} ms predicted, MFU "
                        f"{100 * f['checked_mfu']:.1f} %")
        else:
            how = (f"estimated ~{format_bytes(f['predicted_bytes']).strip()} per chip{chips}"
                   + (", not compiled" if v.get("scaled_to_xla") else ", analytic"))
        lines.append(f"    {f['command']}   # {how}")
    return "\n".join(lines)


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for a plan: analytic memory and FLOPs, step time on the chip,
    XLA's figures of the compiled step and their gap to the analytic ones when present, then
    the verdict where a chip was named (and the settings that would fit where it does not)."""
    lines = [f"note: {note}" for note in result.get("notes", ())]
    at = f", at its peak, {result['peak_phase']}" if result.get("peak_phase") else ""
    lines += [_setting_line(result), f"parameters {result['num_params']:,}",
              f"per-chip memory (analytic{at}):"]
    lines += [f"  {key:<16} {format_bytes(result.get('bytes_' + key, 0))}"
              for key in _MEMORY_ROWS if key != "context_kv" or result.get("bytes_context_kv")]
    if result.get("context_kv_gather_bytes"):
        lines.append(f"context parallelism: keys and values gathered over context, "
                     f"{format_bytes(result['context_kv_gather_bytes']).strip()} received per "
                     f"chip per step (forward gathers, backward reduce-scatters)")
    lines.append(f"FLOPs per step (model) {result['model_flops_per_step']:.3e}, per chip "
                 f"(hardware) {result['hardware_flops_per_chip']:.3e}")
    if "chip" in result:
        lines.append(_chip_line(result))
    if result.get("xla") is not None:
        lines += _xla_lines(result)
    lines += [f"warning: {w}" for w in result["warnings"]]
    if "verdict" in result:
        lines += _verdict_lines(result)
    return "\n".join(lines)
