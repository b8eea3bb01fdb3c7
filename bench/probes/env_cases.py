"""Every environment variable the runtime reads, set to values a careless launch or an
attacker gives: empty, letters, a superscript digit, negative, huge, ``1e-9``, and for
MASTER_ADDR a name that does not resolve. Each runs ENV_PROGRAM on one launched rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.probes import verdicts
from bench.probes.programs import ENV_PROGRAM
from bench.probes.runner import Case, CaseBody, Run, Verdict

VALUES = {"empty": "", "letters": "abc", "superscript": "²", "negative": "-1",
          "huge": "99999999999999999999", "tiny": "1e-9"}  # fmt: skip

# What each value must do: refuse, succeed (blank means unset), or either (a path: any name
# is a path; a clean refusal or a run that works are both right).
REFUSE_ALL = {name: "refuse" for name in VALUES}
BLANK_UNSET = {**REFUSE_ALL, "empty": "succeed"}
EXPECT: dict[str, dict[str, str]] = {
    "RANK": REFUSE_ALL,
    "WORLD_SIZE": REFUSE_ALL,
    "LOCAL_RANK": REFUSE_ALL,
    "LOCAL_WORLD_SIZE": REFUSE_ALL,
    "MASTER_ADDR": REFUSE_ALL,
    "MASTER_PORT": REFUSE_ALL,
    # (a huge count of restarts is odd but harmless: a store prefix)
    "TORCHELASTIC_RESTART_COUNT": {**REFUSE_ALL, "empty": "either", "huge": "either"},
    "MACROGEN_TIMEOUT": BLANK_UNSET,
    "MACROGEN_BACKEND": BLANK_UNSET,
    "MACROGEN_TP_SIZE": BLANK_UNSET,
    "MACROGEN_FRESH": BLANK_UNSET,
    "MACROGEN_DISABLE": BLANK_UNSET,
    "MACROGEN_SHOW_EXPANDED": BLANK_UNSET,
    "MACROGEN_CACHE_DIR": {name: "either" for name in VALUES},
    "MACROGEN_TUNING": {name: "either" for name in VALUES},
}
# Extra values beyond the common six.
EXTRA = {
    "MASTER_ADDR": {"unresolvable": "no-such-host.invalid"},
    "MASTER_PORT": {"zero": "0", "above_65535": "99999", "spaces": " 29500 "},
    "MACROGEN_TIMEOUT": {"nan": "nan", "inf": "inf", "zero": "0", "a_year_and_more": "1e9"},
    "MACROGEN_TP_SIZE": {"two_on_one_rank": "2", "zero": "0"},
    "WORLD_SIZE": {"zero": "0"},
    "RANK": {"past_the_world": "1"},
    "LOCAL_RANK": {"past_the_local_world": "3"},
    "LOCAL_WORLD_SIZE": {"zero": "0"},
}
EXTRA_EXPECT = {("MASTER_PORT", "spaces"): "either"}


def _body(var: str, value: str, expect: str) -> Callable[[Path], CaseBody]:
    def body(folder: Path) -> CaseBody:
        (folder / "train.py").write_text(ENV_PROGRAM)
        # a bound on any wait: an unset MACROGEN_TIMEOUT would let torch wait 30 minutes
        env = {var: value}
        if var != "MACROGEN_TIMEOUT":
            env["MACROGEN_TIMEOUT"] = "20"
        result = yield Run(cli=("run", "train.py"), ranks=1, env=env, timeout=90)
        if expect == "refuse":
            return verdicts.program_refusal(result)
        bad = verdicts.succeeded(result)
        if bad is None:
            return Verdict("ok", "ran: " + verdicts.first_line(result.out))
        if expect == "either" and bad.outcome == "failed" and bad.line.startswith("refused"):
            return Verdict("ok", bad.line.removeprefix("refused where it should run: "))
        return bad

    return body


def cases() -> list[Case]:
    found = []
    for var, expects in EXPECT.items():
        values = {**{k: (VALUES[k], e) for k, e in expects.items()}}
        for name, value in EXTRA.get(var, {}).items():
            values[name] = (value, EXTRA_EXPECT.get((var, name), "refuse"))
        for name, (value, expect) in values.items():
            found.append(Case("env", f"{var}={name}", _body(var, value, expect)))
    return found
