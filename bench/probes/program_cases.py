"""Programs: applied twice on every path, training equal to serial on 2 ranks (replicate,
zero1, fsdp, tp, pp, dp="none"), @tile indexes that wrap or run out of range, tampered
tuning records, plans verify must catch, torch.compile with pipeline_step and FSDP, ranks
started with different world sizes, and junk bytes against a parameter-server job."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from bench.probes import sockets, verdicts
from bench.probes.programs import NONE_DP, TRAIN, TWICE, tile
from bench.probes.runner import Case, CaseBody, Join, Result, Run, Start, Until, Verdict

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-10  # float64 programs

TWICE_CALLS = {
    "replicate": 'dp="replicate"',
    "zero1": 'dp="zero1"',
    "fsdp": 'dp="fsdp"',
    "none": 'dp="none"',
    "tp": 'tp=2, tp_plan={"blocks.0": "colwise", "blocks.1": "rowwise"}',
    "pp": "pp=2, microbatches=2",
    "servers": 'servers=1, tp_plan={"emb": "server"}',
}
PARITY = {  # name: (mg.parallelize's arguments, optimizer, shard the optimizer)
    "replicate": ('dp="replicate"', "SGD", False),
    "zero1": ('dp="zero1"', "AdamW", True),
    "fsdp": ('dp="fsdp"', "AdamW", False),
    "tp": ('tp=2, tp_plan={"blocks.0": "colwise", "blocks.1": "rowwise"}', "AdamW", False),
    "fsdp_compiled": ('dp="fsdp"', "SGD", False),
}


def result_of(result: Result) -> dict | None:
    for line in result.out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return None


def _twice(call: str) -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(TWICE.format(call=call))
        result = yield Run(cli=("run", "train.py"), timeout=90)
        verdict = verdicts.program_refusal(result)
        if verdict.outcome == "ok" and "already" not in verdict.line:
            return Verdict("failed", "refused, but not for being applied twice: " + verdict.line)
        return verdict

    return body


def _parity(source: str, ranks: int, *, expect_warning: str = "") -> Callable[[Path], CaseBody]:
    """The unexpanded file serially, then expanded on ``ranks`` ranks: equal results."""

    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(source)
        serial = yield Run(script="train.py", timeout=240)
        if (bad := verdicts.succeeded(serial)) is not None:
            return Verdict("failed", "the serial program: " + bad.line)
        parallel = yield Run(cli=("run", "train.py"), ranks=ranks, timeout=300)
        if (bad := verdicts.succeeded(parallel)) is not None:
            return bad
        want, got = result_of(serial), result_of(parallel)
        if want is None or got is None:
            return Verdict("failed", "no RESULT line")
        worst = verdicts.close(got, want, TOLERANCE)
        if worst > TOLERANCE:
            return Verdict("silent wrong", f"exit 0, parameters differ from serial by {worst:.3g}")
        if expect_warning and expect_warning not in parallel.err:
            return Verdict("silent wrong", f"equal, but no warning saying {expect_warning!r}")
        return Verdict("ok", f"equal to serial (worst {worst:.1e})")

    return body


def _train(call: str, optimizer: str, shard: bool, compiled: bool = False) -> str:
    source = TRAIN.format(call=call, optimizer=optimizer,
                          shard="opt = mg.shard_optimizer(opt)\n" if shard else "")  # fmt: skip
    if compiled:
        source = source.replace("loss = ((model(ids[rows])", "loss = ((compiled(ids[rows])")
        source = source.replace(
            "opt = torch.optim", "compiled = torch.compile(model)\nopt = torch.optim"
        )
    return source


def _pipeline(compiled: bool) -> str:
    source = _train("pp=2, microbatches=2", "SGD", False)
    step = "loss = ((model(ids[rows]) - y[rows]) ** 2).mean()\n    loss.backward()"
    call = "torch.compile(model)" if compiled else "model"
    source = source.replace(
        step,
        f"loss = mg.pipeline_step({call}, ids[rows], y[rows], lambda o, t: ((o - t) ** 2).mean())",
    )
    source = source.replace("losses.append(float(loss))", "")
    return source.replace(
        'for name, p in model.named_parameters():\n    full = p.full_tensor() if hasattr(p, "full_tensor") else p\n    params[name] = full.detach().reshape(-1).tolist()',
        "state = model.full_state_dict() if hasattr(model, 'full_state_dict') else model.state_dict()\n"
        "for name, p in state.items():\n    params[name] = p.detach().reshape(-1).tolist()",
    )


def _tile(loop: str, body_line: str) -> Callable[[Path], CaseBody]:
    """Serial (the loop as Python runs it) and expanded: a refusal, or the same output."""

    def body(folder: Path) -> CaseBody:
        (folder / "t.py").write_text(tile(body_line, loop))
        serial = yield Run(script="t.py", timeout=60)
        expanded = yield Run(cli=("run", "t.py"), timeout=90)
        if (bad := verdicts.crash(expanded)) is not None:
            return bad
        if expanded.code != 0:
            judged = verdicts.refused(expanded) if verdicts.TRACEBACK in expanded.err else (
                verdicts.Verdict("ok", verdicts.error_line(expanded.err)) if "error:" in expanded.err
                else Verdict("failed", verdicts.first_line(expanded.err)))  # fmt: skip
            return judged
        if serial.code != 0:
            return Verdict(
                "silent wrong",
                "Python raises ("
                + verdicts.first_line(serial.err.splitlines()[-1] if serial.err else "")
                + "), the expansion ran",
            )
        want, got = result_of(serial), result_of(expanded)
        worst = verdicts.close(got, want, 0.0)
        if worst > 1e-6:
            return Verdict("silent wrong", f"exit 0, output {got} where Python gives {want}")
        return Verdict("ok", "expanded, equal to the Python loop")

    return body


TILES = {
    "x[i - 1] from 0 (wraps)": ("for i in range(M):", "out[i] = x[i - 1]"),
    "x[i - 1] from 1": ("for i in range(1, M):", "out[i] = x[i - 1]"),
    "x[i + 1] to M (past the end)": ("for i in range(M):", "out[i] = x[i + 1]"),
    "x[i + 1] to M - 1": ("for i in range(M - 1):", "out[i] = x[i + 1]"),
    "x[M - 1 - i] (reversed)": ("for i in range(M):", "out[i] = x[M - 1 - i]"),
    "x[-1] (a constant that wraps)": ("for i in range(M):", "out[i] = x[-1]"),
    "x[2 * i] (past the end)": ("for i in range(M):", "out[i] = x[2 * i]"),
    "x[2 * i + 1] to M // 2": ("for i in range(M // 2):", "out[i] = x[2 * i + 1]"),
    "out[i - 1] (writes at -1)": ("for i in range(M):", "out[i - 1] = x[i]"),
    "x[i - M] (always negative)": ("for i in range(M):", "out[i] = x[i - M]"),
    "x[i - 3] from 2": ("for i in range(2, M):", "out[i] = x[i - 3]"),
    "x[i + 1] step 2": ("for i in range(0, M, 2):", "out[i] = x[i + 1]"),
    "x[i % 3]": ("for i in range(M):", "out[i] = x[i % 3]"),
}

TUNED_KEY = "build.parallelize.layout"
TUNED = {  # name: (the record's winner, world size, expected: refuse / either)
    "tp4 on 6 heads": ("tp4 pp1 replicate mb1", 4, "refuse"),
    "tp8 on 4 ranks": ("tp8 pp1 replicate mb1", 4, "refuse"),
    "zero1 under auto": ("tp1 pp1 zero1 mb1", 4, "refuse"),
    "pp2 with 1 micro-batch": ("tp1 pp2 replicate mb1", 2, "refuse"),
    "tp0": ("tp0 pp1 replicate mb1", 4, "refuse"),
    "negative tp": ("tp-2 pp1 replicate mb1", 4, "refuse"),
    "garbage layout": ("fast please", 4, "refuse"),
    "huge tp": ("tp" + "9" * 30 + " pp1 replicate mb1", 4, "refuse"),
}


def _tuning(winner: object, world: int, probe: bool = True) -> Callable[[Path], CaseBody]:
    """A record as autotune writes it (with its model's probe: 6 heads, 8 blocks), its
    winner edited by hand; expand must refuse it (without the probe too)."""

    def body(folder: Path) -> CaseBody:
        from macrogen.autotune import database
        from macrogen.autotune.probe import MEASURES

        src = folder / "layout_auto.py"
        shutil.copy(REPO / "examples" / "layout_auto.py", src)
        record = {
            "candidates": [{"values": {TUNED_KEY: winner}, "time_s": 0.01, "samples": 3}],
            "generation": 1,
            "key": {
                "entry": ":build",
                "file": src.name,
                "params": [TUNED_KEY],
                "target": "cpu",
                "world_size": world,
            },  # fmt: skip
            "source_hash": database.source_hash(src.read_text()),
            "winner": {TUNED_KEY: winner},
        }
        if probe:
            arguments = {"layout": "tp1 pp1 replicate mb1", "tp_plan": {"layers.*.fc": "colwise"}}
            record["layout_probe"] = {
                "shape": {"blocks": 8, "divisible": {"layers.0.n_head": 6}, "rows": 16},
                "arguments": database.encode_values(arguments),
                "source_hash": record["source_hash"],
                "measures": MEASURES,
            }
        db = {"format": "macrogen-tuning", "version": 2, "records": [record]}
        (folder / "macrogen_tuning.json").write_text(json.dumps(db))
        before = verdicts.snapshot(folder)
        result = yield Run(cli=("expand", "layout_auto.py", "-o", "out.py"), timeout=60)
        return verdicts.command_refusal(result, before, folder)

    return body


def _verify(source: str, entry: str, expect: str) -> Callable[[Path], CaseBody]:
    """macrogen verify: ``expect`` "pass" (exit 0), "catch" (exit 1 naming the worst row)."""

    def body(folder: Path) -> CaseBody:
        (folder / "model.py").write_text(source)
        result = yield Run(cli=("verify", "model.py", "--entry", entry, "--world-size", "2"),
                           timeout=300)  # fmt: skip
        if (bad := verdicts.crash(result)) is not None:
            return bad
        text = result.err + result.out
        said = result.err if result.err.strip() else result.out  # the verdict, else the table
        last = next((ln for ln in reversed(said.splitlines()) if ln.strip()), "")
        if verdicts.TRACEBACK in text or result.code == 3:
            return Verdict("traceback", verdicts.error_line(text))
        if expect == "either":  # caught (1) or fixed by the engine (0): never a traceback
            return Verdict(
                "ok" if result.code in (0, 1) else "failed", f"exit {result.code}: {last}"
            )
        if expect == "pass":
            return Verdict("ok" if result.code == 0 else "failed", f"exit {result.code}: {last}")
        if result.code == 0:
            return Verdict("silent wrong", f"verify passed a plan that differs: {last}")
        return Verdict("ok" if result.code == 1 else "failed", f"exit {result.code}: {last}")

    return body


def _world_sizes_disagree(folder: Path) -> CaseBody:
    (folder / "train.py").write_text("import macrogen as mg\nmg.launch()\nprint('launched')\n")
    result = yield Run(cli=("run", "train.py"), ranks=2, env={"MACROGEN_TIMEOUT": "10"},
                       rank_env={1: {"WORLD_SIZE": "3"}}, timeout=90)  # fmt: skip
    verdict = verdicts.program_refusal(result)
    if verdict.outcome == "ok" and result.seconds > 60:
        return Verdict("hang", f"refused only after {result.seconds:.0f} s: {verdict.line}")
    return verdict


def _server_job(transport: str) -> Callable[[Path], CaseBody]:
    """tests/param_server_probe_train.py's job (2 workers, 1 server) stopped at its gate:
    its listeners (no wildcard; loopback only for RPC) and, on p2p, junk sent to every one of
    them; then it must train on to the serial program's tables and parameters."""

    def body(folder: Path) -> CaseBody:
        gate = folder / "gate"
        gate.mkdir()
        script = str(REPO / "tests" / "param_server_probe_train.py")
        args = ("--gate", str(gate), "--out", "state.pt", "--transport", transport)
        job = yield Start(Run(script=script, args=args, ranks=3, env={"PROBE_TEST_TIMEOUT": "200"},
                              timeout=240))  # fmt: skip
        names = ["pid_0", "pid_1", "pid_2", "ready_0", "ready_1"]
        ready = yield Until(lambda: all((gate / n).exists() for n in names), 200)
        found = sockets.listeners(job.pids) if ready else []
        wild = [f for f in found if f[1] in sockets.WILDCARDS]
        if ready and transport == "p2p":
            for _, host, port in found:
                sockets.send_junk(host, port)
        (gate / "go").write_text("")
        result = yield Join(job)
        if not ready:
            return verdicts.crash(result) or Verdict("failed", "the job never reached its gate: "
                                                      + verdicts.error_line(result.err))  # fmt: skip
        if (bad := verdicts.succeeded(result)) is not None:
            return bad
        if wild or (transport == "rpc" and any(h != "127.0.0.1" for _, h, _ in found)):
            return Verdict("silent wrong", f"listeners beyond loopback: {sorted(set(found))}")
        check = (
            "import torch\nfrom tests.param_server_probe_train import serial\n"
            "got, want = torch.load('state.pt'), serial(6)\n"
            "worst = max((got[k] - v).abs().max().item() for k, v in want.items())\n"
            "print('RESULT', '{\"worst\": %r, \"steps\": %d}' % (worst, int(got['emb.step'])))\n"
        )
        (folder / "check.py").write_text(check)
        compared = yield Run(script="check.py", timeout=120)
        got = result_of(compared)
        if got is None:
            return Verdict(
                "failed", "the comparison did not run: " + verdicts.error_line(compared.err)
            )
        if got["worst"] > 1e-12 or got["steps"] != 6:
            return Verdict("silent wrong", f"trained to {got} against the serial tables")
        ports = len(found)
        junk = f", junk sent to all {ports}" if transport == "p2p" else ""
        return Verdict("ok", f"{ports} listeners, none wildcard{junk}; equal to serial")

    return body


def cases() -> list[Case]:
    found = [Case("twice", mode, _twice(call)) for mode, call in TWICE_CALLS.items()]
    found += [Case("tile", name, _tile(*spec)) for name, spec in TILES.items()]
    found += [Case("tuning", name, _tuning(w, n)) for name, (w, n, _) in TUNED.items()]
    found.append(
        Case("tuning", "tp4, the probe removed", _tuning(TUNED["tp4 on 6 heads"][0], 4, False))
    )
    for name, (call, optimizer, shard) in PARITY.items():
        source = _train(call, optimizer, shard, compiled=name.endswith("_compiled"))
        found.append(Case("parity", name, _parity(source, 2), ranks=True))
    found.append(Case("parity", "pp", _parity(_pipeline(False), 2), ranks=True))
    found.append(
        Case("parity", "pp pipeline_step(torch.compile)", _parity(_pipeline(True), 2), ranks=True)
    )
    found.append(Case("parity", "dp=none warns", _none_dp(), ranks=True))
    found.append(Case("launch", "WORLD_SIZE 2 and 3", _world_sizes_disagree, ranks=True))
    from tests.verify_programs import GEMMA, HEADS, LLAMA

    found += [
        Case("verify", "undivided heads", _verify(HEADS, ":undivided", "catch"), ranks=True),
        Case("verify", "divided heads", _verify(HEADS, ":divided", "pass"), ranks=True),
        Case("verify", "Gemma-style embedding", _verify(GEMMA, ":build", "either"), ranks=True),
        Case("verify", "Llama", _verify(LLAMA, ":build", "pass"), ranks=True),
        Case("server", "p2p: junk on every port", _server_job("p2p"), ranks=True),
        Case("server", "rpc: loopback listeners", _server_job("rpc"), ranks=True),
    ]
    return found


def _none_dp() -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(NONE_DP)
        result = yield Run(cli=("run", "train.py"), ranks=2, timeout=120)
        if (bad := verdicts.succeeded(result)) is not None:
            return bad
        if "diverge" not in result.err:
            return Verdict("silent wrong", "dp='none' on 2 data ranks, no warning")
        return Verdict("ok", next(ln for ln in result.err.splitlines() if "diverge" in ln).strip())

    return body
