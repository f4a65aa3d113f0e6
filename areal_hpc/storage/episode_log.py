"""A rollout log's episode data (multi-turn samples, env/episode.py), beside rollout_log.py's rows.

Per output token, ``/tokens/loss_mask`` (u1): 1 for a token the model sampled (trained), 0 for
an observation token (an environment's output: never trained; its version is -1 and its
behaviour log-probability 0). Per row, its turns and its tool calls, as flat arrays with end
offsets in a row column (as the token arrays have; variable-length data is not SWMR-safe):

  /turns/end        i8  where each turn ends, an offset into the row's output tokens
  /turns/is_sample  u1  1: a model turn, 0: an observation
  /tools/name S32, /tools/args S256 (cut), /tools/output_bytes i8, /tools/seconds f8,
  /tools/error S96 (empty: it ran)
  /traj/turns_end, /traj/tools_end  i8, end offsets into /turns/* and /tools/*

Per row, ``/traj/discard`` (u1, schema 5 on): why the episode's tokens are not trained, an index
into DISCARD_CAUSES (0: they are; env.on_error says what a discarded episode does to its group).

All optional: a single-turn sample stores a mask of ones and no turns nor tool calls, and reads
back as one model turn over its output; a log written before them (no such datasets) reads so
too, and a writer that continues it adds them (its earlier rows: ones, no turns, no tools).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from .h5_read import RolloutLogError, damage_is_an_error

NO_VERSION = -1                     # an observation token's version (env/episode.py)
MASK = "loss_mask"
TOOL_TEXT_BYTES = {"name": 32, "args": 256, "error": 96}
GROUPS = {"turns": {"end": "i8", "is_sample": "u1"},
          "tools": {"name": "S32", "args": "S256", "output_bytes": "i8", "seconds": "f8",
                    "error": "S96"}}
ROW_ENDS = {"turns": "turns_end", "tools": "tools_end"}     # /traj/<column> per group
# Why an episode is discarded: not at all; its environment's call timed out, its process died
# (or never started), it raised, its answer was refused (garbage, ids past the vocabulary), or
# the environment discarded the episode itself (Step.discard). The model did none of these.
DISCARD_CAUSES = ("", "timeout", "died", "raised", "refused", "env")
DISCARD = "discard"


def utf8_cut(value: Any, limit: int) -> bytes:
    """Text as a fixed-length column stores it: UTF-8, cut at a character boundary to `limit`
    bytes (None: empty)."""
    raw = ("" if value is None else str(value)).encode("utf-8")[:limit]
    return raw.decode("utf-8", errors="ignore").encode("utf-8")


def _tool(call: Any) -> dict:
    return dataclasses.asdict(call) if dataclasses.is_dataclass(call) else dict(call)


def _unsampled(x: dict, v: np.ndarray, bad: np.ndarray, name_of) -> None:
    raise ValueError(f"{name_of(x)}: versions is negative: {int(v[bad][0])} at output token "
                     f"{int(np.argmax(bad))}, where {MASK} is 1 (a trained token must have "
                     "been sampled)")


def _episode_mask(x: dict, n: int, v: np.ndarray, name_of) -> np.ndarray:
    """`x`'s loss mask, checked against its versions and log-probabilities."""
    m = np.asarray(x[MASK])
    if m.shape != (n,) or not ((m == 0) | (m == 1)).all():
        raise ValueError(f"{name_of(x)}: {MASK} must hold one 0 or 1 per output token ({n})")
    m = m.astype(np.uint8)
    if (bad := (m == 1) & (v < 0)).any():
        _unsampled(x, v, bad, name_of)
    if (bad := (m == 0) & (v != NO_VERSION)).any():
        raise ValueError(f"{name_of(x)}: versions is {int(v[bad][0])} at output token "
                         f"{int(np.argmax(bad))}, where {MASK} is 0 (an observation token has "
                         f"version {NO_VERSION})")
    if (np.asarray(x["behav_logprobs"], np.float64)[m == 0] != 0).any():
        raise ValueError(f"{name_of(x)}: behav_logprobs of an observation token ({MASK} 0) "
                         "must be 0")
    return m


def episode_columns(trajs: Sequence[dict], name_of) -> tuple[np.ndarray, dict, dict]:
    """(the loss mask of every output token, concatenated; per group its arrays; per group the
    rows' entry counts) of `trajs`. A ValueError naming the trajectory and the field for a mask
    that disagrees with the versions (mask 1: version >= 0, mask 0: version -1), turns that do
    not tile the output or disagree with the mask, or a tool record that is not one."""
    masks, cols = [], {g: {k: [] for k in f} for g, f in GROUPS.items()}
    counts = {g: np.zeros(len(trajs), np.int64) for g in GROUPS}
    for k, x in enumerate(trajs):
        n, v = len(x["output_tokens"]), np.asarray(x["versions"])
        if x.get(MASK) is None:             # a single-turn sample: every token sampled
            m = np.ones(n, np.uint8)
            if n and v.min() < 0:
                _unsampled(x, v, v < 0, name_of)
        else:
            m = _episode_mask(x, n, v, name_of)
        masks.append(m)
        if x.get("turn_ends") is not None:
            ends = np.asarray(x["turn_ends"], dtype=np.int64)
            sample = np.asarray(x.get("turn_is_sample", np.ones(len(ends))), dtype=np.int64)
            starts = np.concatenate([[0], ends[:-1]])
            if (len(sample) != len(ends) or (len(ends) and ends[-1] != n)
                    or (ends <= starts).any() or (not len(ends) and n)
                    or not np.isin(sample, (0, 1)).all()):
                raise ValueError(f"{name_of(x)}: turn_ends must rise to the {n} output tokens, "
                                 "with one turn_is_sample (0 or 1) each")
            if any((m[a:b] != s).any() for a, b, s in zip(starts, ends, sample)):
                raise ValueError(f"{name_of(x)}: turn_is_sample disagrees with {MASK} (a model "
                                 "turn is trained, an observation is not)")
            cols["turns"]["end"].append(ends)
            cols["turns"]["is_sample"].append(sample.astype(np.uint8))
            counts["turns"][k] = len(ends)
        for call in x.get("tool_calls") or ():
            c = _tool(call)
            secs, size = float(c.get("seconds", 0.0)), int(c.get("output_bytes", 0))
            if not (np.isfinite(secs) and secs >= 0 and size >= 0):
                raise ValueError(f"{name_of(x)}: tool_calls: seconds {secs} and output_bytes "
                                 f"{size} must be finite and >= 0")
            for field in TOOL_TEXT_BYTES:
                cols["tools"][field].append([utf8_cut(c.get(field), TOOL_TEXT_BYTES[field])])
            cols["tools"]["output_bytes"].append([size])
            cols["tools"]["seconds"].append([secs])
            counts["tools"][k] += 1
    arrays = {g: {k: np.concatenate(v).astype(GROUPS[g][k]) if v else np.zeros(0, GROUPS[g][k])
                  for k, v in f.items()} for g, f in cols.items()}
    mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    return mask, arrays, counts


def discard_codes(trajs: Sequence[dict], name_of) -> np.ndarray:
    """The /traj/discard column of `trajs` (a trajectory's `discard`: a cause, "" or absent for
    none); a ValueError naming the trajectory for an unknown cause."""
    codes = np.zeros(len(trajs), np.uint8)
    for k, x in enumerate(trajs):
        cause = x.get(DISCARD) or ""
        if cause not in DISCARD_CAUSES:
            raise ValueError(f"{name_of(x)}: {DISCARD} {cause!r} is not one of {DISCARD_CAUSES[1:]}")
        codes[k] = DISCARD_CAUSES.index(cause)
    return codes


def row_episode(f, i: int, n_out: int, o0: int, o1: int) -> dict:
    """Row i's episode fields from the open log `f` (output tokens [o0, o1), `n_out` of them):
    loss_mask, turn_ends, turn_is_sample, tool_calls (a list of dicts, error None = it ran),
    discard (its cause, "" for none; the code checked by the caller)."""
    tok, t = f["tokens"], f["traj"]
    mask = tok[MASK][o0:o1] if MASK in tok else np.ones(n_out, np.uint8)
    out = {MASK: np.asarray(mask, np.uint8),
           DISCARD: DISCARD_CAUSES[int(t[DISCARD][i])] if DISCARD in t else ""}
    spans = {}
    for g, col in ROW_ENDS.items():
        if col in t and g in f:
            a, b = (int(t[col][i - 1]) if i else 0), int(t[col][i])
            spans[g] = (a, b) if 0 <= a <= b else (0, 0)
        else:
            spans[g] = (0, 0)
    a, b = spans["turns"]
    if b > a:
        out["turn_ends"] = np.asarray(f["turns/end"][a:b], np.int64)
        out["turn_is_sample"] = np.asarray(f["turns/is_sample"][a:b], np.uint8)
    else:                           # a single-turn sample: one model turn over its output
        out["turn_ends"] = np.asarray([n_out] if n_out else [], np.int64)
        out["turn_is_sample"] = np.ones(len(out["turn_ends"]), np.uint8)
    a, b = spans["tools"]
    tools = {k: f[f"tools/{k}"][a:b] for k in GROUPS["tools"]} if b > a else {}
    out["tool_calls"] = [
        {"name": tools["name"][j].decode("utf-8", "replace"),
         "args": tools["args"][j].decode("utf-8", "replace"),
         "output_bytes": int(tools["output_bytes"][j]), "seconds": float(tools["seconds"][j]),
         "error": tools["error"][j].decode("utf-8", "replace") or None} for j in range(b - a)]
    return out


def add_datasets(f, output_end: int, group_ends: dict[str, int], chunks: int, err) -> None:
    """The episode datasets of the log open in `f`, created where absent (a new log, or one
    from before episodes: its `output_end` tokens were all sampled, mask 1) and cut back to
    `group_ends` (a torn append's entries after the committed rows); `err(text)` is the
    exception for a damaged log."""
    if MASK not in f["tokens"]:
        f["tokens"].create_dataset(MASK, data=np.ones(output_end, "u1"), maxshape=(None,),
                                   chunks=(max(chunks, 1),), fletcher32=True)
    for grp, fields in GROUPS.items():
        g = f.require_group(grp)
        for name, dt in fields.items():
            if name not in g:
                g.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(chunks,),
                                 fletcher32=True)
            elif g[name].shape[0] < group_ends[grp]:
                raise err(f"damaged rollout log (/{grp}/{name} has {g[name].shape[0]} entries, "
                          f"the offsets need {group_ends[grp]})")
            g[name].resize((group_ends[grp],))


def mask_between(reader, a: int, b: int) -> np.ndarray:
    """The loss mask of output tokens [a, b) of `reader`'s log (a RolloutReader), as bools
    (all True in a log from before episodes: every token sampled and trained); read by blocks
    of rows (a large run's tokens do not fit in memory)."""
    with damage_is_an_error(reader.path, f"/tokens/{MASK}"):
        if MASK not in reader.f["tokens"]:
            return np.ones(b - a, bool)
        m = reader.f["tokens"][MASK][a:b]
    if len(m) != b - a or (m > 1).any():
        raise RolloutLogError(f"{reader.path}: damaged rollout log (/tokens/{MASK} [{a}, {b}) "
                              "is short or holds a value other than 0 and 1)")
    return m.astype(bool)
