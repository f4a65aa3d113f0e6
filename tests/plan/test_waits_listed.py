"""Every bounded wait of the code is in `plan time`'s table (areal_hpc/plan/bounds.py) or says
why it is not: the config keys that bound a wait (every `*_s` key of the config) and the
package's bound constants (`*_TIMEOUT_S`, `*_WAIT_S`, `*_GRACE_S`, `*_STALL_S`). A new one fails
here until it is put in the table or given its reason below."""
import dataclasses
import re
from pathlib import Path

from areal_hpc.config import load
from areal_hpc.config.schema import RunConfig
from areal_hpc.plan import bounds, budget

ROOT = Path(__file__).resolve().parents[2]
R32 = ROOT / "configs/qwen2_5_32b_math.yaml"
CLOCK = ["checkpoint.signal_lead_s=9000", "checkpoint.time_limit_s=86400"]   # areal_32b.sh's

# Time keys that are not a wait on another rank or on work the step-time model estimates.
NOT_WAITS = {
    "rollout.heartbeat_s": "a cadence (how often a sign of life is sent); the silences it "
                           "feeds are rollout.generator_timeout_s's rows",
    "rollout.engine_restart_window_s": "a window for counting engine faults, not a wait",
    "checkpoint.time_limit_s": "the job's time limit, the clock the signal's lead counts against",
    "reward.math_timeout_s": "one sample's scoring in a reward worker of the generator, off "
                             "the critical path; past it the sample scores 0",
    "reward.fn_timeout_s": "one call of a user's reward function, as reward.math_timeout_s",
    "env.call_timeout_s": "one call into an environment's process; past it the episode ends "
                          "(discarded), not the job",
    "env.start_timeout_s": "an environment process's start, as env.call_timeout_s",
}
# The package's bound constants: the key whose row covers it, or why it has none.
CONSTANTS = {
    "DEFAULT_TIMEOUT_S": "rollout.collective_timeout_s",
    "MAX_TIMEOUT_S": "the largest value a time key may take (config/rules.py), not a wait",
    "MAX_REWARD_TIMEOUT_S": "the largest reward timeout a config may set, not a wait",
    "SYMPY_TIMEOUT_S": "inside reward.math_timeout_s (one symbolic comparison)",
    "WORKER_START_TIMEOUT_S": "a reward worker's start on the generator's node; a failed one is "
                              "restarted (reward/pool.py), no rank waits on it",
    "IMPORT_TIMEOUT_S": "importing a user's reward module at the preflight, before any rank",
    "KILL_GRACE_S": "a killed sandbox's exit, inside a sample's test time",
    "START_TIMEOUT_S": "a code sandbox's set-up, inside a sample's scoring",
    "END_TIMEOUT_S": "a killed PID namespace's emptying, inside a reward worker's or an "
                     "environment's end",
    "TEMPLATE_TIMEOUT_S": "one prompt's rendering at the preflight, before any rank",
    "WATCHDOG_GRACE_S": "weights.timeout_s: NCCL's watchdog backs up the host's deadline on a "
                        "weight-group collective this much later; the host acts first",
}
_CONSTANT = re.compile(r"^([A-Z][A-Z0-9_]*_(?:TIMEOUT|WAIT|GRACE|STALL)_S)\s*=", re.M)


def _time_keys(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _time_keys(value, prefix + f.name + ".")
        elif f.name.endswith("_s"):
            yield prefix + f.name


def _table_keys() -> set[str]:
    est = budget.estimate_time(load(R32, CLOCK))
    return {w.key for w in bounds.waits(est) if w.key is not None}


def test_every_time_key_of_the_config_is_in_the_waits_table_or_says_why_not():
    keys, table = set(_time_keys(RunConfig())), _table_keys()
    assert table <= keys, table - keys                          # the table names real keys
    missing = keys - table - set(NOT_WAITS)
    assert not missing, f"bounded waits missing from `plan time`'s table: {sorted(missing)}"
    assert not set(NOT_WAITS) & table, "a key both in the table and excused from it"
    assert set(NOT_WAITS) <= keys, set(NOT_WAITS) - keys        # no stale excuse


def test_every_bound_constant_of_the_package_is_accounted_for():
    found = {}
    for path in sorted((ROOT / "areal_hpc").rglob("*.py")):
        for name in _CONSTANT.findall(path.read_text()):
            found.setdefault(name, path.relative_to(ROOT))
    unknown = set(found) - set(CONSTANTS)
    assert not unknown, {n: str(found[n]) for n in unknown}
    assert set(CONSTANTS) <= set(found), set(CONSTANTS) - set(found)   # no stale entry
    table = _table_keys()
    for name, where in CONSTANTS.items():
        if "." in where and " " not in where:          # a key: its row must exist
            assert where in table, (name, where)
