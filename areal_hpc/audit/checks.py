"""The audit's checks (areal_hpc/audit/__init__.py lists them), each from the files alone."""
from __future__ import annotations

import collections

import numpy as np

from ..storage import run_dir as run_files
from ..storage.rollout_log import (ABORTED, DROPPED_STALE, FAILED, NO_SEED, NOT_CONSUMED, PARTIAL,
                                  ROLLED_BACK, RolloutReader)
from ..train.shares import guard_decisions

from .run import (EXAMPLES, AuditedRun, Check, Groups, Projection, any_trained, some,
                  status_name)


# ------------------------------------------------------------------------------------ checks

def run_checks(run: AuditedRun, groups: Groups, proj: Projection | None) -> list[Check]:
    """The eight guarantees of the module docstring (areal_hpc/audit/__init__.py), in order."""
    return [_check_once(run), _check_steps(run, groups), _check_prompts(run, groups, proj),
            _check_pending(run, groups, proj), _check_versions(run, proj),
            _check_rolled_back(run, groups), _check_continued(run, groups), _check_masks(run)]


def _missing(present: np.ndarray, bound: int) -> tuple[int, list[int]]:
    """How many of 0..bound-1 are absent from `present` (sorted, unique), and the first few;
    never builds the range (a damaged file may hold a huge number)."""
    p = present[(present >= 0) & (present < bound)]
    edges = np.concatenate([[-1], p, [bound]]).astype(np.int64)
    first: list[int] = []
    for k in np.flatnonzero(np.diff(edges) > 1):
        lo, hi = int(edges[k]) + 1, int(edges[k + 1])
        first.extend(range(lo, min(hi, lo + EXAMPLES - len(first))))
        if len(first) >= EXAMPLES:
            break
    return bound - len(p), first


def _listing(first: list, count: int) -> str:
    """`first` examples of `count` items."""
    return ", ".join(str(x) for x in first) + (f" (and {count - len(first)} more)"
                                               if count > len(first) else "")


def _check_once(run: AuditedRun) -> Check:
    name = "no trajectory trained twice"
    idx = np.flatnonzero(run.consumed >= 0)
    r = idx[np.lexsort((run.sidx[idx], run.pid[idx]))]
    same = (run.pid[r][1:] == run.pid[r][:-1]) & (run.sidx[r][1:] == run.sidx[r][:-1])
    if not same.any():
        return Check(name, True,
                     [f"{len(idx)} trajectories trained, each (prompt_id, sample_idx) once"])
    firsts = np.flatnonzero(same & ~np.concatenate([[False], same[:-1]]))
    examples = []
    for k in firsts[:EXAMPLES]:
        j, hits = k, [int(r[k])]
        while j < len(same) and same[j]:
            hits.append(int(r[j + 1]))
            j += 1
        examples.append(f"prompt {run.pid[hits[0]]} sample {run.sidx[hits[0]]}: "
                        + ", ".join(f"row {h} at step {run.consumed[h]}" for h in hits))
    more = [f"(and {len(firsts) - EXAMPLES} more)"] if len(firsts) > EXAMPLES else []
    return Check(name, False, [f"{len(idx)} trajectories trained; {len(firsts)} of them more "
                               f"than once ({int(same.sum())} extra trainings):", *examples, *more])


def _check_steps(run: AuditedRun, groups: Groups) -> Check:
    B, n, total, c = run.B, run.n, run.cfg.train.total_steps, run.ck_step
    trained = run.consumed >= 0
    steps, counts = np.unique(run.consumed[trained], return_counts=True)
    S = int(steps[-1]) + 1 if len(steps) else 0
    lines, bad = [], []
    n_missing, first_missing = _missing(steps, S)
    if n_missing:
        bad.append(f"{n_missing} step(s) consumed nothing, though later ones did: "
                   f"{_listing(first_missing, n_missing)}")
    wrong = counts != B * n
    if wrong.any():
        bad.append(f"{int(wrong.sum())} step(s) consumed other than B x n = {B * n} trajectories: "
                   + some(f"step {s}: {k}" for s, k in zip(steps[wrong], counts[wrong])))
    status, uniform = groups.status(run.consumed)
    good = groups.whole & uniform & (status >= 0)
    partial = np.flatnonzero(trained & ~good[groups.of_row])
    if len(partial):
        bad.append(f"{len(partial)} trained row(s) are not part of a whole group of {n} trained "
                   "at one step: " + some(f"{groups.rows(g)} (prompt {groups.pid[g]}: "
                                           f"{groups.states(g, run.consumed)})"
                                           for g in np.unique(groups.of_row[partial])))
    if S > total:
        bad.append(f"steps up to {S - 1} consumed, but train.total_steps is {total}")
    if not bad:
        lines.append(f"steps 0-{S - 1} consumed, each {B * n} trajectories in {B} whole groups "
                     f"of {n}" if S else "no step trained yet")
    bad.extend(_metrics_problems(run, S, lines))
    bad.extend(_guard_problems(run, groups, S, lines))
    if c is not None:
        if c > S:
            bad.append(f"the newest checkpoint is of step {c}, but the log shows only {S} steps "
                       "trained")
        elif S > c:
            lines.append(f"steps {c}-{S - 1} were trained after the newest checkpoint (step {c}): "
                         "a resume trains them again")
    state = (f"complete ({S} of {total} steps)" if S == total and c in (None, total)
             else f"{S} of {total} steps trained")
    return Check("training steps continuous", not bad, [state, *lines, *bad])


def _guard_problems(run: AuditedRun, groups: Groups, S: int, lines: list[str]) -> list[str]:
    """What the collapse guards decided at each step, as metrics.jsonl counts it, against the
    log: `zero_var_groups` (groups without learning signal: equal rewards) and `filtered_seqs`
    (trajectories `train.filter_zero_variance`, `train.overlong: filter` and `env.on_error` left
    out of the loss), decided from the log's rewards, lengths, finish reasons and discards by the trainer's own
    function (`train.shares.guard_decisions`, on the stored float32 rewards; with
    `overlong: shape` on the shaped ones). Each such group is consumed by its step like any
    other, so nothing is lost, and the counts must be the log's."""
    if not run.metrics or not S:
        return []
    counted = {rec["step"]: rec for _, rec in run.metrics if "zero_var_groups" in rec}
    if not counted or not len(groups.starts):
        return []
    status, uniform = groups.status(run.consumed)
    trained = np.flatnonzero(groups.whole & uniform & (status >= 0) & (status < S))
    zero = np.zeros(S, np.int64)
    left_out = np.zeros(S, np.int64)
    if len(trained):
        rows = (groups.starts[trained, None] + np.arange(run.n)).ravel()
        keep, _, zero_var, _ = guard_decisions(
            run.reward[rows], run.out_len[rows], run.cut[rows], run.cfg.train, run.n,
            run.cfg.rollout.max_new_tokens, run.discard[rows], run.cfg.env.on_error)
        steps = status[trained]
        zero = np.bincount(steps[zero_var], minlength=S)
        left_out = np.bincount(steps, weights=(~keep).reshape(-1, run.n).sum(axis=1),
                               minlength=S).astype(np.int64)
    differ = [f"step {s}: {rec['zero_var_groups']} counted, {zero[s]} in the log"
              for s, rec in sorted(counted.items()) if s < S and rec["zero_var_groups"] != zero[s]]
    filtered = [f"step {s}: {rec['filtered_seqs']} left out, {left_out[s]} by the log"
                for s, rec in sorted(counted.items())
                if s < S and "filtered_seqs" in rec and rec["filtered_seqs"] != left_out[s]]
    lines.append(f"{int(zero.sum())} group(s) without learning signal over {S} steps, each "
                 f"consumed by its step; {int(left_out.sum())} trajectories left out of the loss "
                 "by the guards")
    bad = []
    if differ:
        bad.append("metrics.jsonl's zero_var_groups disagrees with the log's rewards: " + some(differ))
    if filtered:
        bad.append("metrics.jsonl's filtered_seqs disagrees with the guards on the log: "
                   + some(filtered))
    return bad


def _metrics_problems(run: AuditedRun, S: int, lines: list[str]) -> list[str]:
    """metrics.jsonl against the log's S steps: 0..S-1, once each, in order, version = step + 1
    (the last step may be missing when it is past the newest checkpoint: the trainer marks the
    log first, then writes the line)."""
    if run.metrics is None:
        if not S:
            lines.append("no metrics.jsonl, and no step trained")
            return []
        return [f"no metrics.jsonl, though the log shows {S} steps trained"]
    got = np.asarray([rec["step"] for _, rec in run.metrics], dtype=np.int64)
    bad = []
    if len(got) == S and (got == np.arange(S)).all():
        lines.append(f"metrics.jsonl: steps 0-{S - 1}, once each, in order" if S
                     else "metrics.jsonl: no steps, as the log")
    elif run.ck_step is not None and S - 1 >= run.ck_step and len(got) == S - 1 \
            and (got == np.arange(S - 1)).all():
        lines.append(f"metrics.jsonl: steps 0-{S - 2}; step {S - 1} is in the log only (the job "
                     "stopped between marking it and logging it, after the newest checkpoint: a "
                     "resume trains it again)")
    else:
        u, k = np.unique(got, return_counts=True)
        n_absent, absent = _missing(u, S)
        what = [f"logged more than once: {some(u[k > 1].tolist())}" if (k > 1).any() else "",
                f"missing: {_listing(absent, n_absent)}" if n_absent else "",
                f"beyond the log's steps: {some(u[u >= S].tolist())}" if (u >= S).any() else ""]
        what = [w for w in what if w] or ["out of order"]
        bad.append(f"metrics.jsonl does not hold steps 0-{S - 1} once each: " + "; ".join(what))
    versions = [(k, rec) for k, rec in run.metrics
                if "version" in rec and rec["version"] != rec["step"] + 1]
    if versions:
        bad.append("metrics.jsonl records whose version is not step + 1: "
                   + some(f"line {k} (step {rec['step']}, version {rec['version']!r})"
                           for k, rec in versions))
    return bad


def _check_prompts(run: AuditedRun, groups: Groups, proj: Projection | None) -> Check:
    """Every prompt id issued (prompt ids are data-cursor positions, so 0..cursor-1 were all
    issued) classified by its groups in the log (as a resume sees it) and the checkpoint."""
    name = "every issued prompt accounted for"
    column = proj.consumed if proj is not None else run.consumed
    status, uniform = groups.status(column)
    by_pid: dict[int, list[int]] = collections.defaultdict(list)
    for g, p in enumerate(groups.pid.tolist()):
        by_pid[p].append(g)
    ctrl = run.ctrl
    inflight = set(ctrl.inflight_prompt_ids.tolist()) if ctrl is not None else set()
    known = np.asarray(sorted(set(by_pid) | inflight), dtype=np.int64)
    bound = (int(ctrl.cursor_consumed) if ctrl is not None
             else int(known[-1]) + 1 if len(known) else 0)
    n_norows, norows = _missing(known, bound)      # issued, with no rows, not in flight
    bad, unknown = [], []
    cats: collections.Counter = collections.Counter()
    lost, early = [], []
    for p in known.tolist():
        gs = by_pid.get(p, [])
        live = [g for g in gs if status[g] != ROLLED_BACK]
        trained = [g for g in live if status[g] >= 0]
        pending = [g for g in live if status[g] == NOT_CONSUMED]
        dropped = [g for g in live if status[g] == DROPPED_STALE]
        failed = [g for g in live if status[g] == FAILED]
        rolled = len(live) < len(gs)
        if trained:
            cat = "trained"
            # once trained, a prompt is never issued again; a dropped group may only precede it;
            # a failed one is never issued again either
            again = pending + [g for g in dropped if g > trained[0]] + failed
            if again or p in inflight:
                bad.append(f"prompt {p} trained at step {status[trained[0]]} was issued again ("
                           + (f"{groups.rows(again[0])}: {status_name(int(status[again[0]]))}"
                              if again else "in flight at the checkpoint") + ")")
        elif pending:
            cat = "pending"
            if len(pending) > 1 or p in inflight:
                bad.append(f"prompt {p} has {len(pending)} pending group(s)"
                           + (" and is in flight too" if p in inflight else "")
                           + f": {some(groups.rows(g) for g in pending)}")
        elif p in inflight:
            cat = "in flight"
        elif dropped:
            cat = "given up"
            if run.policy == "reissue" and len(dropped) <= run.max_reissues:
                if ctrl is None:            # may have been queued for reissue when it stopped
                    cat = "unknown"
                    unknown.append(p)
                else:
                    early.append(f"prompt {p} (dropped {len(dropped)} time(s), last "
                                 f"{groups.rows(dropped[-1])})")
        elif failed:
            cat = "failed"      # no sampled token: given up at once (Ledger.arrived)
        elif rolled and p >= bound and ctrl is not None:
            cat = "after the checkpoint"
        elif ctrl is None:
            cat = "unknown"
            unknown.append(p)
        else:
            cat = "lost"
            lost.append(f"prompt {p} (only rolled-back or partial rows: {groups.rows(gs[0])})")
        cats[cat] += 1
        if any(status[g] == PARTIAL for g in live) and cat in ("trained", "pending", "in flight"):
            cats["continued"] += 1
        if dropped and cat in ("trained", "pending", "in flight"):
            cats["dropped, reissued"] += 1
        if rolled and cat in ("trained", "pending", "given up"):
            cats["rolled back, issued again"] += 1
    if ctrl is not None:
        lost_count = len(lost) + n_norows
        if lost_count:
            bad.append(f"{lost_count} prompt(s) lost: issued, but neither trained, pending, in "
                       "flight nor dropped: "
                       + _listing(lost[:EXAMPLES] + [f"prompt {p} (no rows)" for p in norows]
                                  [:max(0, EXAMPLES - len(lost))], lost_count))
    if early:
        bad.append(f"{len(early)} prompt(s) given up after a stale drop although stale_policy "
                   f"reissue allows {run.max_reissues} reissue(s): {some(early)}")
    if run.policy == "keep" and (status == DROPPED_STALE).any():
        bad.append("groups were dropped as stale although rollout.stale_policy is keep")
    odd = np.flatnonzero(~(groups.whole & uniform) & ~any_trained(groups, run.consumed))
    if len(odd):                                # (groups with a trained row: check 2)
        bad.append(f"{len(odd)} group(s) of untrained rows are not one whole group of {run.n} "
                   "samples of one status: " + some(
                       f"{groups.rows(g)} (prompt {groups.pid[g]}: {groups.states(g, column)})"
                       for g in odd))
    if ctrl is not None:
        seen = int(ctrl.rollout_rows)
        beyond = np.flatnonzero(run.pid[:seen] >= bound)
        if len(beyond):
            bad.append(f"rows the checkpoint saw hold prompt ids at or past its data cursor "
                       f"({bound}): {some(f'row {i} (prompt {run.pid[i]})' for i in beyond)}")
        dropped_groups = int(((status == DROPPED_STALE) & uniform).sum())
        if ctrl.dropped_stale != dropped_groups:
            bad.append(f"the checkpoint counts {ctrl.dropped_stale} group(s) dropped as stale "
                       f"(dropped_stale), the log {dropped_groups}")
        if ctrl.lost_stale is not None and ctrl.lost_stale != cats["given up"]:
            bad.append(f"the checkpoint counts {ctrl.lost_stale} prompt(s) given up "
                       f"(lost_stale), the log {cats['given up']}")
    policy = f"stale_policy {run.policy}" + (f", at most {run.max_reissues} reissue(s)"
                                             if run.policy == "reissue" else "")
    issued = bound + int((known >= bound).sum())
    source = ("by the ids in the log (no checkpoint: the data cursor is unknown)" if ctrl is None
              else f"ids 0-{bound - 1} by the checkpoint's data cursor" if bound
              else "none by the checkpoint's data cursor")
    if ctrl is not None and issued > bound:
        source += f", {issued - bound} more after it"
    seen_as = "; classified as a resume sees the log" if proj is not None and proj.went_on else ""
    lines = [f"{issued} prompt(s) issued: {source}{seen_as}",
             f"trained: {cats['trained']}; pending: {cats['pending']}; in flight at the "
             f"checkpoint (issued again by a resume): {cats['in flight']}",
             f"dropped as stale and issued again: {cats['dropped, reissued']}; dropped and given "
             f"up: {cats['given up']} ({policy})",
             f"preempted mid-generation and continued from their partial rows: "
             f"{cats['continued']}",
             f"vLLM engines restarted after a fault, as the steps' metrics recorded: "
             f"{_engine_restarts(run)} (their samples continued in the new engine from their "
             f"tokens: no prompt issued again for them)",
             f"failed (no sampled token: every episode ended before the model's first turn), "
             f"never trained, given up: {cats['failed']}",
             f"rolled back and issued again: {cats['rolled back, issued again']}"
             + (f"; issued after the checkpoint (a resume rolls them back and issues them "
                f"again): {cats['after the checkpoint']}" if cats["after the checkpoint"] else "")]
    if ctrl is not None:
        lines.append(f"lost: {len(lost) + n_norows}")
        if ctrl.lost_stale is None:
            lines.append("the checkpoint predates its lost_stale counter: given-up prompts not "
                         "compared with it")
        return Check(name, not bad, lines + bad, {"lost": len(lost) + n_norows,
                                                  "engine_restarts": _engine_restarts(run)})
    why = "no valid checkpoint" if run.ckpt is None else "the checkpoint holds no controller state"
    count = len(unknown) + n_norows
    lines.append(f"not checkable: {why}, so the prompts in flight (or queued for reissue) when "
                 f"the job stopped are unknown" + (
                     f"; {count} prompt id(s) are neither trained, pending nor given up for good: "
                     + _listing((unknown + norows)[:EXAMPLES], count) if count else ""))
    return Check(name, False if bad else None, lines + bad)


def _engine_restarts(run: AuditedRun) -> int:
    """Engine restarts over every attempt, from metrics.jsonl's per-attempt running count (a
    requeued attempt's generators count from 0 again)."""
    total = prev = 0
    for _, rec in run.metrics or []:
        cur = rec.get("engine_restarts")
        if not isinstance(cur, int):
            continue
        total += cur - prev if cur >= prev else cur
        prev = cur
    return total


def _check_pending(run: AuditedRun, groups: Groups, proj: Projection | None) -> Check:
    name = "pending rows = the checkpoint's buffered rows"
    if run.ckpt is None:
        return Check(name, None, ["not checkable: no valid checkpoint in checkpoints/"])
    if proj is None:
        return Check(name, None, [f"not checkable: {run.ckpt.name} holds no controller state"])
    ctrl, c = run.ctrl, run.ck_step
    buf = ctrl.buffer_rows.astype(np.int64)
    ends = [0, *ctrl.buffer_group_ends.astype(np.int64).tolist()]
    bad = list(proj.problems)
    pending = np.flatnonzero(proj.consumed == NOT_CONSUMED)
    extra = np.setdiff1d(pending, buf)
    if len(extra):
        bad.append(f"{len(extra)} pending row(s) the checkpoint did not buffer (a resume would "
                   f"never train them): {some(f'row {i} (prompt {run.pid[i]})' for i in extra)}")
    split = []
    for k, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
        rows = buf[a:b]
        g = int(groups.of_row[rows[0]]) if len(rows) and rows[0] < len(run.pid) else None
        if g is None or not groups.whole[g] or groups.lens[g] != len(rows) \
                or not np.array_equal(rows, groups.starts[g] + np.arange(len(rows))):
            split.append(f"buffered group {k} (rows {some(rows.tolist(), 3)})")
    if split:
        bad.append(f"{len(split)} buffered group(s) are not one whole group of the log: "
                   f"{some(split)}")
    # accepted: +1 per group received, -1 per group dropped (StalenessManager), so the trained
    # groups plus the buffered ones; generated_tokens: every row received, dropped ones too
    # (PARTIAL rows are not received trajectories: their tokens count in the row continuing them)
    accepted = run.B * c + len(ends) - 1
    if ctrl.accepted != accepted:
        bad.append(f"the checkpoint counts {ctrl.accepted} accepted group(s), its step and "
                   f"buffer make {accepted} (B x {c} trained + {len(ends) - 1} buffered)")
    tokens = int(run.out_len[(proj.consumed != ROLLED_BACK) & (proj.consumed != PARTIAL)].sum())
    if ctrl.generated_tokens != tokens:
        bad.append(f"the checkpoint counts {ctrl.generated_tokens} generated tokens, the log's "
                   f"rows it saw hold {tokens}")
    seen_as = " (as a resume sees the log)" if proj.went_on else ""
    lines = [f"{len(buf)} row(s) in {len(ends) - 1} group(s) buffered at {run.ckpt.name}; "
             f"{len(pending)} pending in the log{seen_as}"]
    if not bad:
        lines.append("the same rows, in whole groups; the checkpoint's counters (accepted "
                     "groups, generated tokens) agree with the log")
    return Check(name, not bad, lines + bad)


def _check_versions(run: AuditedRun, proj: Projection | None) -> Check:
    """Token versions against the step that trained them. Staleness as `staleness.staleness_of`
    defines it: the consuming version minus the trajectory's oldest token version (0 without
    tokens); the version that consumes step s's batch is s (the controller's version when it
    takes the batch: the steps trained so far)."""
    name = "versions <= training step, staleness <= η"
    s = run.consumed
    used = s >= 0
    has = used & (run.vmax >= 0)
    ahead = np.flatnonzero(has & (run.vmax > s))
    stale = np.where(has, s - run.vmin, 0)
    over = np.flatnonzero(has & (stale > run.eta))
    bad, unsure = [], []
    if len(ahead):
        bad.append(f"{len(ahead)} trained row(s) hold a token newer than their step: "
                   + some(f"row {i} (prompt {run.pid[i]} sample {run.sidx[i]}) at step {s[i]} "
                           f"has version {run.vmax[i]}" for i in ahead))
    values, counts = np.unique(stale[used], return_counts=True)
    lines = [f"{int(used.sum())} trained trajectories; staleness (step - oldest token version) "
             + (", ".join(f"{v}: {k}" for v, k in zip(values.tolist(), counts.tolist())) or "-")
             + f"; η = {run.eta}"]
    if len(over):
        what = (f"{len(over)} trained row(s) more than η = {run.eta} versions stale: "
                + some(f"row {i} (prompt {run.pid[i]}) at step {s[i]}, oldest version "
                        f"{run.vmin[i]}" for i in over))
        if run.policy == "keep":
            unsure.append(f"not a guarantee of this run (stale_policy keep trains stale groups "
                          f"anyway): {what}")
        else:
            bad.append(what)
    if proj is not None and not proj.went_on:   # untrained rows: at most the version reached
        late = np.flatnonzero((s < 0) & (s != ROLLED_BACK) & (run.vmax > run.ck_step))
        if len(late):
            bad.append(f"{len(late)} untrained row(s) hold versions beyond the {run.ck_step} "
                       f"steps trained: {some(f'row {i} (version {run.vmax[i]})' for i in late)}")
    if run.metrics and used.any():              # metrics.jsonl's staleness_max, step by step
        order = np.argsort(s[used], kind="stable")
        steps, st = s[used][order], stale[used][order]
        u, first = np.unique(steps, return_index=True)
        top = dict(zip(u.tolist(), np.maximum.reduceat(st, first).tolist()))
        differ = [rec for _, rec in run.metrics if rec["step"] in top
                  and isinstance(rec.get("staleness_max"), (int, float))
                  and rec["staleness_max"] != top[rec["step"]]]
        if differ:
            bad.append("metrics.jsonl's staleness_max disagrees with the log's rows: "
                       + some(f"step {rec['step']}: {rec['staleness_max']} logged, "
                               f"{top[rec['step']]} in the log" for rec in differ))
    return Check(name, False if bad else (None if unsure else True), lines + bad + unsure)


def _check_rolled_back(run: AuditedRun, groups: Groups) -> Check:
    name = "rolled-back rows were never trained"
    rb = run.consumed == ROLLED_BACK
    if not rb.any():
        return Check(name, True, ["no row rolled back (no resume went back past rows)"])
    edges = np.diff(np.concatenate([[0], rb.astype(np.int8), [0]]))
    blocks = list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1))
    _, uniform = groups.status(run.consumed)
    mixed = [g for g in np.unique(groups.of_row[rb]) if not uniform[g]]
    keys = set(zip(run.pid[rb].tolist(), run.sidx[rb].tolist()))
    t = run.consumed >= 0
    again = len(keys & set(zip(run.pid[t].tolist(), run.sidx[t].tolist())))
    lines = [f"{int(rb.sum())} row(s) rolled back in {len(blocks)} block(s): "
             + some(f"rows {a}-{b}" for a, b in blocks)
             + f"; {again} of their trajectories were generated again and trained",
             "no rolled-back row counts for a step; each block is whole groups",
             "not checkable: whether a row was trained before its job died and the resume "
             "rolled it back (ROLLED_BACK replaces the step it held; such a step was trained "
             "again from the checkpoint: check 2)"]
    bad = []
    if mixed:
        bad.append(f"{len(mixed)} group(s) only partly rolled back: "
                   + some(f"{groups.rows(g)} (prompt {groups.pid[g]})" for g in mixed))
        lines[1] = "no rolled-back row counts for a step"
    return Check(name, not bad, lines + bad)


def _check_continued(run: AuditedRun, groups: Groups) -> Check:
    """Every PARTIAL row (a sample as far as it got at a preemption) is continued by the next
    row of its prompt and sample that was not rolled back: that row starts with the partial
    row's tokens, behaviour log-probabilities and versions (all of it, for a sample that had
    finished), or was generated again from the same seed under the one version its tokens came
    from (the generator's rule with per-request seeds), or, with none yet, it is in the
    checkpoint's partial groups, to be continued."""
    name = "continued samples start with their partial rows"
    part = np.flatnonzero(run.consumed == PARTIAL)
    if not len(part):
        return Check(name, True, ["no partial rows (no preemption with samples in flight)"], {"kept_tokens": 0})
    live = np.flatnonzero(run.consumed != ROLLED_BACK)
    later: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for i in live.tolist():
        later[(int(run.pid[i]), int(run.sidx[i]))].append(i)
    ctrl = run.ctrl
    referenced = set()
    if ctrl is not None:
        for first, k in zip(ctrl.partial_first_row.tolist(), ctrl.partial_rows.tolist()):
            referenced.update(range(first, first + k))
    bad, waiting, after, redrawn, kept, continued = [], [], [], [], 0, 0
    with RolloutReader(run.run_dir / run_files.ROLLOUTS) as r:
        for i in part.tolist():
            key = (int(run.pid[i]), int(run.sidx[i]))
            nxt = next((j for j in later[key] if j > i), None)
            if nxt is None:
                if i in referenced:
                    waiting.append(i)
                elif ctrl is None or i >= int(ctrl.rollout_rows):
                    after.append(i)     # no checkpoint saw it: a resume rolls it back
                else:
                    bad.append(f"row {i} (prompt {key[0]} sample {key[1]}): partial, never "
                               "continued, and not among the checkpoint's partial groups")
                continue
            a, b = r[i], r[nxt]
            k = len(a["output_tokens"])
            whole = a["finish_reason"] not in ABORTED
            same = (len(b["output_tokens"]) >= k and (not whole or len(b["output_tokens"]) == k)
                    and all(np.array_equal(a[f], b[f][:k])
                            for f in ("output_tokens", "behav_logprobs", "versions"))
                    # one with no token yet starts afresh (an episode: from its environment's
                    # prompt, which a fresh reset gives again)
                    and (k == 0 or np.array_equal(a["prompt_tokens"], b["prompt_tokens"])))
            v = a["versions"]
            regenerated = (not whole and k > 0 and a["seed"] != NO_SEED and b["seed"] == a["seed"]
                           and (v == v[0]).all() and len(b["versions"]) > 0
                           and b["versions"][0] == v[0])
            if not same and regenerated:    # generated again from its seed (the generator's rule)
                redrawn.append(nxt)
            elif not same:
                bad.append(f"row {nxt} (prompt {key[0]} sample {key[1]}) does not start with "
                           f"partial row {i} ({k} tokens{', finished' if whole else ''})")
            else:
                continued += 1
                kept += k
    lines = [f"{len(part)} partial row(s); {continued} continued by a later row that starts with "
             f"them ({kept} tokens kept across preemptions); {len(waiting)} waiting in the "
             "checkpoint's partial groups"]
    if redrawn:
        lines.append(f"{len(redrawn)} generated again from their seeds under the weights their "
                     "partial tokens came from, and not repeating those tokens (kernels that are "
                     f"not batch-invariant): {some(f'row {i}' for i in redrawn)}")
    if after:
        lines.append(f"{len(after)} partial row(s) no checkpoint saw (a resume rolls them back "
                     f"and issues their prompts again): {some(f'row {i}' for i in after)}")
    if bad:
        lines.append(f"{len(bad)} partial row(s) not continued as they should be: {some(bad)}")
    return Check(name, not bad, lines, {"kept_tokens": kept})


def _check_masks(run: AuditedRun) -> Check:
    """Multi-turn episodes (env/episode.py): every token the loss trains (loss mask 1) was
    sampled (version >= 0), so every observation token (version -1) is masked out of the loss;
    and no sampled token is masked out (the episode builder masks observations only). A log
    from before episodes has no mask: every token trained, each must have been sampled."""
    name = "trained tokens sampled, observation tokens masked"
    unsampled = np.flatnonzero(run.unsampled) if run.unsampled is not None else np.zeros(0, int)
    masked = (np.flatnonzero(run.masked_sampled) if run.masked_sampled is not None
              else np.zeros(0, int))
    lines = [f"{len(run.pid)} rows' output tokens: mask 1 with version -1 in {len(unsampled)}, "
             f"mask 0 with a version in {len(masked)}"]
    bad = []
    if len(unsampled):
        bad.append(f"{len(unsampled)} row(s) train a token that was not sampled (loss mask 1, "
                   "version -1): " + some(
                       f"row {i} (prompt {run.pid[i]} sample {run.sidx[i]}) output token "
                       f"{run.first_unsampled[i]}, {run.unsampled[i]} such" for i in unsampled))
    if len(masked):
        bad.append(f"{len(masked)} row(s) mask a sampled token out of the loss (loss mask 0, "
                   "version >= 0): " + some(f"row {i} (prompt {run.pid[i]} sample "
                                             f"{run.sidx[i]})" for i in masked))
    return Check(name, not bad, lines + bad)
