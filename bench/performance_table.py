"""The Performance page's tables (docs/performance.md), rendered from bench/results/*.json.

Every figure in the tables is read from the JSON a bench wrote; the footnote names each file's
date, so a reader sees which sitting a row came from. `make bench` ends with `--write`, which
replaces the page's block between the two markers; a unit test keeps the block and the
results in step.

    python bench/performance_table.py            # print the block
    python bench/performance_table.py --write    # rewrite it in docs/performance.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"
START = "<!-- performance-table:start (bench/performance_table.py --write) -->"
END = "<!-- performance-table:end -->"


def _load(results: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def _when(doc: dict) -> str:
    stamp = doc.get("created") or doc.get("when") or "?"
    return stamp[:16].replace("T", " ")


def _tps(m: dict) -> str:
    if "tokens_per_s_range" not in m:
        return f"{m['tokens_per_s']:,.0f}"
    lo, hi = m["tokens_per_s_range"]
    return f"{m['tokens_per_s']:,.0f} ({lo:,.0f}–{hi:,.0f})"


def _seconds(median: float, span: list | tuple | None) -> str:
    return f"**{median:.2f} s** ({span[0]:.2f}–{span[1]:.2f})" if span else f"**{median:.2f} s**"


def _target(text: str, met: bool) -> str:
    """A target cell that says whether this run met it."""
    return f"{text}: met" if met else f"{text}: **not met**"


def _at_most(share: float) -> str:
    return f"≤ {100 * share:g} %"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %" if x < 0 else f"{100 * x:.1f} %"


def vs_pytorch(doc: dict) -> list[str]:
    wide = any("project-avx512" in r["summary"] for r in doc["results"].values())   # a CPU with AVX-512
    rows = ["| case | this project | " + ("its kernels built for AVX-512 | " if wide else "") +
            "MindSpore's stock ops | HF LLaMA, eager | HF LLaMA, `torch.compile` | × eager | × compiled | "
            "peak RSS, × eager |", "|---|---|---|---|---|---|---|---|" + ("---|" if wide else "")]
    for name, r in doc["results"].items():
        s = r["summary"]
        p, eager, compiled = s["project"], s.get("torch"), s.get("torch.compile")
        avx512 = [_tps(s["project-avx512"]) if "project-avx512" in s else "—"] if wide else []
        cells = [name, _tps(p), *avx512, _tps(s["mindspore"]), _tps(eager) if eager else "—",
                 _tps(compiled) if compiled else "—",
                 f"**{p['tokens_per_s'] / eager['tokens_per_s']:.2f}×**" if eager else "—",
                 f"**{p['tokens_per_s'] / compiled['tokens_per_s']:.2f}×**" if compiled else "—",
                 f"{p['peak_rss_gb']:.2f} GB, {p['peak_rss_gb'] / eager['peak_rss_gb']:.2f}×" if eager
                 else f"{p['peak_rss_gb']:.2f} GB"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def dp_scaling(doc: dict) -> list[str]:
    rows = ["| config | 1 rank × 1 core | 2 ranks × 1 core each | × 1 core | 1 rank, whole machine | × whole machine |",
            "|---|---|---|---|---|---|"]
    for name, r in doc["results"].items():
        t, span = r["tokens_per_s"], r.get("tokens_per_s_range", {})

        def cell(side: str) -> str:
            return _tps({"tokens_per_s": t[side], **({"tokens_per_s_range": span[side]} if side in span else {})})

        rows.append(f"| {name} | {cell('one_core')} | {cell('two_ranks')} | **{r['ratio']:.2f}×** | "
                    f"{cell('whole_machine')} | {r['ratio_to_whole_machine']:.2f}× |")
    return rows


def faults(docs: dict[str, dict]) -> list[str]:
    rows = ["| what | measured: median (range) | target | bench |", "|---|---|---|---|"]
    rec = docs.get("recovery")
    if rec:
        crash = rec["crash"]
        n = f", {rec['repeats']} repeats" if "repeats" in rec else ""
        labels = {"standby": "a rank SIGKILLed → the next generation's first step (the default: warm standby)",
                  "cold": "… cold (`run.standby = false`)",
                  "cold, no compile cache": "… cold, without the compile cache",
                  "cold, MindSpore cluster": "… cold, on MindSpore's cluster (`parallel.local_reduce = false`)"}
        for case, label in labels.items():
            if case in crash:
                target = _target("≤ 3 s", crash[case]["recovery_s"] <= 3) if case == "standby" else ""
                rows.append(f"| {label} | {_seconds(crash[case]['recovery_s'], crash[case].get('range_s'))} | "
                            f"{target} | `recovery.py`{n} |")
        if "cold" in crash:
            c = crash["cold"]
            stages = c["startup_stages_s"]
            rows.append(f"| where the cold restart's time goes (seconds after the kill) | detected {c['detect_s']:.2f}, "
                        f"next generation started {c['start_at_s']:.2f}, compiling (from the cache) from "
                        f"{c['compile_at_s']:.2f} (the interpreter and imports {stages.get('launch', 0):.2f} of it), "
                        f"first step {c['first_step_at_s']:.2f} | | `recovery.py` |")
        rows.append(f"| the daemon SIGKILLed → the first step under the next one | "
                    f"{_seconds(rec['daemon_restart_s'], rec.get('daemon_restart_range_s'))} | "
                    f"{_target('≤ 5 s', rec['daemon_restart_s'] <= 5)} | `recovery.py` |")
        rows.append(f"| … on MindSpore's cluster | {_seconds(rec['daemon_restart_mindspore_cluster_s'], rec.get('daemon_restart_mindspore_cluster_range_s'))}"
                    f" | | `recovery.py` |")
        hang = rec["hang"]
        rows.append(f"| a hung rank detected (no progress for {hang['waited_s']} s; timeout {hang['timeout_s']} s) | "
                    f"{hang['detection_s']:.2f} s after the hang | | `recovery.py` |")
    mn = docs.get("multinode_recovery")
    if mn:
        labels = {"rank_crash": ("a rank SIGKILLed, 2 hosts", 3), "host_lost": ("host 2 of 3 lost", 6),
                  "host0_lost": ("host 0 of 3 lost (the decider, the hub, an etcd member)", 6)}
        for case, (label, target) in labels.items():
            c = mn["cases"].get(case)
            if not c:
                continue
            def lost(v: dict) -> str:
                if "steps_lost" not in v:
                    return ""
                lo, hi = min(v["steps_lost"]), max(v["steps_lost"])
                return f", {v['median_steps_lost']:g} steps lost" + (f" ({lo}–{hi})" if lo != hi else "")
            others = "; ".join(f"{name} {c[variant]['median_s']:.2f} s ({c[variant]['min_s']:.2f}–{c[variant]['max_s']:.2f})"
                               f"{lost(c[variant]) if variant in ('ram', 'buddy') else ''}"
                               for variant, name in (("ram", "with the RAM tier every step"),
                                                     ("buddy", "in buddy placement (each machine its part and a "
                                                               "buddy's copy)"),
                                                     ("cold", "cold"),
                                                     ("cluster", "on MindSpore’s cluster")) if variant in c)
            d, ram = c["default"], c.get("ram")
            every = f" (disk every {mn['checkpoint_interval_steps']})" if "checkpoint_interval_steps" in mn else ""
            met = _target(f"≤ {target} s", d["median_s"] <= target)
            if ram and "steps_lost" in ram:
                met += "; " + _target("≤ 1 step lost (RAM tier)", max(ram["steps_lost"]) <= 1)
            rows.append(f"| {label} → the first step on every host left | **{d['median_s']:.2f} s** "
                        f"({d['min_s']:.2f}–{d['max_s']:.2f}){lost(d)}{every}; {others} | "
                        f"{met} | `multinode_recovery.py`, {c.get('rounds', mn['rounds'])} rounds"
                        + (f" ({c['when'][:16].replace('T', ' ')})" if c.get("when", mn.get("when")) != mn.get("when") else "") + " |")
    scale = docs.get("multinode_scale")
    if scale:
        for size in scale["sizes"]:
            crash, killed = size["rank_crash"], size["decider_killed"]
            rows.append(f"| {size['machines']} machines × {scale['ranks_per_machine']} ranks simulated: a rank crash → "
                        f"every machine stepping; the decider killed → elected, stepping | "
                        f"p50 {crash['first_step_s']['p50']:.2f} s, p99 {crash['first_step_s']['p99']:.2f} s; "
                        f"elected {killed['elected_s']:.2f} s after its lease expired, stepping p50 "
                        f"{killed['first_step_s']['p50']:.2f} s | | `multinode_scale.py` |")
    good = docs.get("goodput")
    if good:
        for r in good["results"]:
            f = r["faulty"]
            # met only where every figure of the pair says so: the ratio of steps moves with the host's pace
            # between the two runs as much as with the kills (the paced figure, where there is one, corrects it)
            figures = [r["goodput"], *([r["ledger"]["paced"]] if (r.get("ledger") or {}).get("paced") is not None else [])]
            target = _target(f"≥ {r['target']:.2f}", min(figures) >= r["target"]) if r.get("target") else ""
            rows.append(f"| goodput, a rank killed every ~{r['interval_s']:.0f} s ({len(f['faults'])} kills in "
                        f"{f['wall_s']:.0f} s) | **{r['goodput']:.3f}**{_ledger(r.get('ledger'))} | {target} | `goodput.py` |")
        mix = good.get("mix")
        if mix and "reruns" in mix:
            rows.append(f"| goodput, kills every ~{mix['kill_every_s']:.0f} s and a flipped bit every "
                        f"~{mix['bitflip_every_s']:.0f} s ({mix['wall_s']:.0f} s) | **{mix['reruns']['goodput']:.3f}** "
                        f"with reruns (`health.rerun`, the default); {mix['today']['goodput']:.3f} rolling back | | "
                        f"`goodput.py --mix` |")
    return rows


def _ledger(ledger: dict | None) -> str:
    """The daemon's goodput ledger of the same runs beside the bench's figure (bench/goodput.py: faulty over clean)."""
    if not ledger or ledger.get("relative") is None:
        return ""
    if ledger.get("paced") is None:          # a result from before the paced figure
        return (f"; the daemon's ledger {ledger['relative']:.3f} ({ledger['difference_points']:+.1f} points; "
                f"{ledger['faulty']:.3f} of the wall time with kills, {ledger['clean']:.3f} without)")
    restarts = (f"; what the restarts alone cost, by the ledger: {ledger['restarts']:.3f}"
                if ledger.get("restarts") is not None else "")
    return (f"; at each run's own pace {ledger['paced']:.3f}, the daemon's ledger {ledger['relative']:.3f} "
            f"({ledger['difference_points']:+.1f} points; {ledger['faulty']:.3f} of the wall time with kills, "
            f"{ledger['clean']:.3f} without){restarts}")


def _checkpoint_stall(stall: dict) -> list[str]:
    """bench/checkpoint_stall.py's rows: the default checksum's figures, the other's beside them."""
    goals, default = stall["targets"], stall["default_checksum"]
    per, names = stall["checksums"], {"crc32c": "CRC32C", "sha256": "sha256"}
    other = next(c for c in per if c != default)
    d, o = per[default], per[other]
    blocked = (f"| an async disk checkpoint (small-20m, {stall['state_bytes'] / 1e6:.0f} MB): the step blocked, "
               f"against a synchronous save | **{100 * d['blocking_over_synchronous']:.1f} %** with {names[default]} "
               f"(the default; {100 * o['blocking_over_synchronous']:.1f} % with {names[other]}: its synchronous save "
               f"is longer){_one_thread(stall, d)} | {_target(_at_most(goals['blocking_over_synchronous']), d['blocking_over_synchronous'] <= goals['blocking_over_synchronous'])} | "
               f"`checkpoint_stall.py` |")
    lost = (f"| … training lost with one every {stall['interval_steps']} steps (a {1000 * stall['step_s']:.0f}-ms step; "
            f"{stall['quads']} rounds of {stall['block_steps']}-step blocks) | **{_pct(d['throughput_loss'])}** "
            f"± {100 * d['throughput_loss_se']:.1f} with {names[default]}: {d['cost_s_per_save']:.2f} s a save, "
            f"{d['cpu_s_per_save']:.2f} CPU s; {names[other]} {_pct(o['throughput_loss'])} ± "
            f"{100 * o['throughput_loss_se']:.1f}: {o['cost_s_per_save']:.2f} s, {o['cpu_s_per_save']:.2f} CPU s"
            f"{_buffered(stall.get('buffered'))} "
            f"(the A/A control {stall['control_s']:+.3f} ± {stall['control_s_se']:.3f} s a block) | "
            f"{_target(_at_most(goals['throughput_loss']), d['throughput_loss'] <= goals['throughput_loss'])} | "
            f"`checkpoint_stall.py` |")
    return [blocked, lost]


def _buffered(b: dict | None) -> str:
    """The same save written through the page cache, measured beside it (the writer's way before O_DIRECT)."""
    if not b:
        return ""
    return (f"; through the page cache (as before) {_pct(b['throughput_loss'])} ± {100 * b['throughput_loss_se']:.1f}: "
            f"{b['cost_s_per_save']:.2f} s, {b['cpu_s_per_save']:.2f} CPU s")


def _one_thread(stall: dict, d: dict) -> str:
    """The blocking copy on the save's threads against one thread, side by side."""
    one = stall.get("blocking_one_thread_s")
    if not one:
        return ""
    ms = lambda xs: 1000 * sorted(xs)[len(xs) // 2]
    return (f"; the copy {ms(d['blocking_s']):.0f} ms on {stall['staging_threads']} threads, {ms(one):.0f} ms on one, "
            f"the synchronous save {ms(d['synchronous_s']):.0f} ms")


def costs(docs: dict[str, dict]) -> list[str]:
    rows = ["| what | measured | target | bench |", "|---|---|---|---|"]
    ram = docs.get("ram_tier")
    if ram:
        goal = ram.get("target_throughput_loss", 0.02)
        rows.append(f"| a RAM checkpoint every {ram['interval_steps']} steps (tiny): throughput lost | "
                    f"**{_pct(ram['block_throughput_loss'])}** ± {100 * ram['block_throughput_loss_se']:.1f} "
                    f"(the A/A control: {_pct(ram['control_throughput_loss'])} ± {100 * ram['control_throughput_loss_se']:.1f}); "
                    f"a save blocks {1000 * ram['blocking_s_median']:.1f} ms, a step is {1000 * ram['step_s']:.1f} ms | "
                    f"{_target(_at_most(goal), ram['block_throughput_loss'] <= goal)} | "
                    f"`ram_tier.py`, {ram['triples']} triples |")
    stall = docs.get("checkpoint_stall")
    if stall and "checksums" in stall:
        rows.extend(_checkpoint_stall(stall))
    elif stall:
        goals = stall["targets"]
        steps = sorted(stall["steps_per_s_plain"])[len(stall["steps_per_s_plain"]) // 2]
        rows.append(f"| an async disk checkpoint (small-20m, {stall['state_bytes'] / 1e6:.0f} MB): the step blocked, "
                    f"against a synchronous save | **{100 * stall['blocking_over_synchronous']:.1f} %** | "
                    f"{_target(_at_most(goals['blocking_over_synchronous']), stall['blocking_over_synchronous'] <= goals['blocking_over_synchronous'])} | "
                    f"`checkpoint_stall.py` |")
        rows.append(f"| … throughput with one every {stall['interval_steps']} steps against none ({steps:.1f} steps/s "
                    f"without) | **{_pct(stall['throughput_loss'])}** lost | "
                    f"{_target(_at_most(goals['throughput_loss']), stall['throughput_loss'] <= goals['throughput_loss'])} | "
                    f"`checkpoint_stall.py` |")
    data = docs.get("data_throughput")
    if data:
        goal = data.get("target_ratio", 20.0)
        rows.append(f"| the input pipeline against what tiny training consumes | **{data['ratio']:.0f}×** "
                    f"({data['pipeline_tokens_per_s']:,.0f} against {data['train_tokens_per_s']:,.0f} tokens/s; the "
                    f"step's wait for data: median {1000 * data['median_data_wait_s']:.2f} ms) | "
                    f"{_target(f'≥ {goal:.0f}×', data['ratio'] >= goal)} | `data_throughput.py` |")
    val = docs.get("validation_cost")
    if val:
        rows.append(_share_row(val, f"the validation loss every {val['interval_steps']} steps "
                                    f"({val['eval_batches']} batches, tiny)", 2, " of wall time", "validation_cost.py"))
    fp = docs.get("fingerprint_cost")
    if fp:
        rows.append(_share_row(fp, f"replica fingerprints every {fp['interval_steps']} steps ({fp['config']})", 3, "",
                               "fingerprint_cost.py"))
    client = docs.get("client_overhead")
    if client:
        share, steps = client["callback_share_of_step"], sorted(client["unsupervised_step_s"])
        rows.append(f"| a user's `Model.train` script supervised through `llm_pretrain_client` (small, "
                    f"{client['width']} wide × {client['layers']} layers, MindSpore's `nn`): the callback a step | "
                    f"**{100 * share:.3f} %** ({client['callback_ms_per_step']:.2f} ms of a "
                    f"{steps[len(steps) // 2]:.2f} s step; the whole step supervised over unsupervised "
                    f"×{client['step_ratio']:.3f}) | "
                    f"{_target(_at_most(client['target_share']), share <= client['target_share'])} | "
                    f"`client_overhead.py` |")
    return rows


def _share_row(doc: dict, what: str, digits: int, of: str, bench: str) -> str:
    """A cost bench's row: its median share (`cost_median`) with the range, against its `target`."""
    lo, hi = doc["cost_range"]
    return (f"| {what} | **{100 * doc['cost_median']:.{digits}f} %** ({100 * lo:.{digits}f}–{100 * hi:.{digits}f} %){of} | "
            f"{_target(_at_most(doc['target']), doc['cost_median'] <= doc['target'])} | `{bench}` |")


def render(results: Path = RESULTS) -> str:
    docs = _load(results)
    parts: list[str] = []
    if "vs_pytorch" in docs:
        doc = docs["vs_pytorch"]
        rounds = max(m.get("rounds", 1) for r in doc["results"].values() for m in r["summary"].values())
        flag = " --recompute" if any(r.get("recompute") for r in doc["results"].values()) else ""
        parts += [f"Against PyTorch (`bench/vs_pytorch.py{flag}`): wall-clock tokens/s, the median of "
                  f"{rounds} interleaved rounds with their range; each implementation in its own process.", ""]
        parts += vs_pytorch(doc) + [""]
    if "dp_scaling" in docs:
        parts += ["Data parallel on one machine (`bench/dp_scaling.py`): wall-clock tokens/s from the step events, "
                  "the same global batch, real `run`s interleaved; target 1.6× on small-20m.", ""]
        parts += dp_scaling(docs["dp_scaling"]) + [""]
    parts += ["Faults and recovery (seconds from the fault to the first step after it):", ""]
    parts += faults(docs) + [""]
    parts += ["What the safety nets cost:", ""]
    parts += costs(docs) + [""]
    parts.append("Measured: " + "; ".join(f"{name} {_when(doc)}" for name, doc in docs.items()) + " (UTC).")
    return "\n".join(parts)


def replace_block(text: str, block: str) -> str:
    """The page with its block between the markers replaced."""
    try:
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} has no block between {START!r} and {END!r}") from None
    return f"{head}{START}\n{block}\n{END}{tail}"


def current_block(text: str) -> str:
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the block in docs/performance.md")
    args = parser.parse_args()
    block = render()
    if args.write:
        PAGE.write_text(replace_block(PAGE.read_text(), block))
    else:
        sys.stdout.write(block + "\n")


if __name__ == "__main__":
    main()
