"""The experiment state an earlier sweep driver left on storage, checked before Tune restores it.

Tune saves its experiment state to a local staging folder and then copies it to storage
(train/_internal/storage.py `_upload_to_fs_path`: pyarrow `copy_files`, which opens the destination for
writing and fills it). A driver killed while that copy runs leaves a file on storage that is empty or cut
short -- seen here: an empty `searcher-state-*.pkl`. Tune's restore reads the newest file of each kind by
name and fails on a damaged one (json / cloudpickle errors), so such a file would stop every rerun.

`check_experiment` looks at every state file at the experiment's root (`*.json`, `*.pkl`: what Tune's
restore downloads), sets aside the damaged ones (renamed to NAME.damaged, which Tune neither lists nor
downloads: nothing is deleted) and returns what the restore goes on from: the trials of the newest intact
experiment state (the one Tune restores) and the newest intact searcher state. The searcher's own state
(configurations handed out) is derived from those trials -- each trial is one configuration the searcher
handed out, and both are saved at the same moment -- so a searcher state older than the experiment state
(its newest copy set aside) cannot make the sweep hand a configuration out twice.

That alone would lose a first driver's whole sweep when the copy it was killed in was that of its
experiment state (each driver rewrites one file of its own session). So each time Tune saves, the sweep's
searcher (which Tune saves right after writing the experiment state to the staging folder) also writes a
copy of that experiment state to storage as NAME.last, atomically (`back_up`: a temporary name and a
rename on a local or shared filesystem; one PUT on S3). A damaged or missing experiment state whose
NAME.last is whole is put back from it (`restored_from`).

No Ray here: pyarrow's filesystem and the two formats (JSON; a pickle is checked opcode by opcode, not
loaded)."""
from __future__ import annotations

import json
import pickletools
from dataclasses import dataclass, field

# TuneController.CKPT_FILE_TMPL and Searcher.CKPT_FILE_TMPL (GrantSearcher writes JSON), checked against the
# installed Tune by ray_compat's hook tune_fillin_sweep when a sweep is built
from spotfill.ray_compat.catalog import TUNE_EXPERIMENT_STATE as EXPERIMENT_STATE  # noqa: E402
from spotfill.ray_compat.catalog import TUNE_SEARCHER_STATE as SEARCHER_STATE  # noqa: E402
TUNER_FILE = "tuner.pkl"                             # written once, when the experiment is created
DAMAGED_SUFFIX = ".damaged"
BACKUP_SUFFIX = ".last"


def intact(data: bytes) -> bool:
    """Whether a saved state file is whole: a pickle that runs to its STOP opcode, or a JSON document."""
    if not data:
        return False
    if data[:1] == b"\x80":                        # pickle protocol 2 and later
        try:
            ops = list(pickletools.genops(data))
        except Exception:                          # cut short: an opcode runs past the end
            return False
        return bool(ops) and ops[-1][0].name == "STOP"
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def trial_configs(experiment_state: bytes, field: str = "config") -> dict[str, dict]:
    """trial id -> search config (or another of its fields: "status"), in Tune's order, from an
    experiment_state-*.json."""
    out = {}
    for trial_json, _meta in json.loads(experiment_state)["trial_data"]:
        trial = json.loads(trial_json)
        out[trial["trial_id"]] = trial.get(field)
    return out


def _of_kind(name: str, kind: tuple[str, str]) -> bool:
    return name.startswith(kind[0]) and name.endswith(kind[1])


@dataclass
class ExperimentCheck:
    set_aside: list[dict] = field(default_factory=list)   # {"file", "as", "bytes"}: damaged, renamed
    restored_from: list[dict] = field(default_factory=list)   # {"file", "from"}: put back from NAME.last
    trials: dict[str, dict] | None = None      # newest intact experiment state's trials (None: no such state)
    statuses: dict[str, str] | None = None     # the same trials' Tune status (PAUSED, TERMINATED, ...)
    searcher: dict | None = None               # newest intact searcher state (GrantSearcher.save), or None
    tuner_intact: bool = True                  # tuner.pkl (Tune cannot restore without it)

    @property
    def restorable(self) -> bool:
        return self.tuner_intact and self.trials is not None


def check_experiment(experiment: str) -> ExperimentCheck:
    """Check the state files at the root of `experiment` (a local path or URI), set the damaged ones aside,
    put back an experiment state from its whole NAME.last copy, and return what a restore goes on from."""
    import pyarrow.fs

    fs, root = pyarrow.fs.FileSystem.from_uri(experiment)
    root = root.rstrip("/")
    files = {i.base_name for i in fs.get_file_info(pyarrow.fs.FileSelector(root))
             if i.type == pyarrow.fs.FileType.File}
    names = sorted(n for n in files if n.endswith((".json", ".pkl")))
    backups = {n[:-len(BACKUP_SUFFIX)] for n in files if n.endswith(BACKUP_SUFFIX) and _of_kind(
        n[:-len(BACKUP_SUFFIX)], EXPERIMENT_STATE)}
    out, taken = ExperimentCheck(), set(files)
    newest: dict[str, bytes] = {}
    for name in sorted(set(names) | backups):
        data = _read(fs, f"{root}/{name}") if name in files else None
        if data is not None and not intact(data):
            target = _free_name(fs, root, name + DAMAGED_SUFFIX, taken)
            fs.move(f"{root}/{name}", f"{root}/{target}")
            out.set_aside.append({"file": name, "as": target, "bytes": len(data)})
            if name == TUNER_FILE:
                out.tuner_intact = False
            data = None
        if data is None and name in backups:
            copy = _read(fs, f"{root}/{name}{BACKUP_SUFFIX}")
            if intact(copy):
                fs.copy_file(f"{root}/{name}{BACKUP_SUFFIX}", f"{root}/{name}")
                out.restored_from.append({"file": name, "from": name + BACKUP_SUFFIX})
                data = copy
        if data is None:
            continue
        for kind in (EXPERIMENT_STATE, SEARCHER_STATE):
            if _of_kind(name, kind):
                newest[kind[0]] = data                # names sort by session time: the last one wins
    if EXPERIMENT_STATE[0] in newest:
        out.trials = trial_configs(newest[EXPERIMENT_STATE[0]])
        out.statuses = trial_configs(newest[EXPERIMENT_STATE[0]], "status")
    if SEARCHER_STATE[0] in newest:
        out.searcher = json.loads(newest[SEARCHER_STATE[0]])
    return out


def _read(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.readall()


def back_up(staging_dir: str, session: str, experiment: str) -> str | None:
    """Copy the experiment state Tune just wrote to `staging_dir` for `session` to `experiment` on storage
    as NAME.last, whole or not at all; returns the copy's name (None: no such file in staging)."""
    import os
    import uuid

    import pyarrow.fs

    name = f"{EXPERIMENT_STATE[0]}{session}{EXPERIMENT_STATE[1]}"
    try:
        with open(os.path.join(staging_dir, name), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    fs, root = pyarrow.fs.FileSystem.from_uri(experiment)
    root, target = root.rstrip("/"), name + BACKUP_SUFFIX
    if fs.type_name == "s3":                      # an object appears whole, when its upload completes
        with fs.open_output_stream(f"{root}/{target}") as f:
            f.write(data)
        return target
    fs.create_dir(root, recursive=True)
    tmp = f"{root}/.spotfill-tmp-{uuid.uuid4().hex[:12]}-{target}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, f"{root}/{target}")              # a rename: atomic on a local or shared filesystem
    return target


def _free_name(fs, root: str, name: str, taken: set[str]) -> str:
    """`name`, or name.N when a file of that name exists (an earlier rerun set one aside already)."""
    import pyarrow.fs

    candidate, n = name, 1
    while candidate in taken or fs.get_file_info(f"{root}/{candidate}").type != pyarrow.fs.FileType.NotFound:
        candidate, n = f"{name}.{n}", n + 1
    taken.add(candidate)
    return candidate


def handed_out(trials: dict[str, dict], configs: list[dict]) -> int | None:
    """How many of `configs` the restored trials account for (the searcher hands them out in order, one
    trial each), or None when the trials are not `configs`' first ones -- another search grid."""
    n = len(trials)
    if n > len(configs):
        return None
    key = lambda c: json.dumps(c, sort_keys=True)         # noqa: E731
    if sorted(map(key, trials.values())) != sorted(map(key, configs[:n])):
        return None
    return n


def back_up_next_to(searcher_file: str, experiment: str) -> None:
    """Tune calls the searcher's save right after writing the experiment state to its staging folder, with
    STAGING/.<uuid>-tmp-searcher-state-<session>.pkl (Searcher.save_to_dir): copy that state to storage
    as NAME.last, whole (back_up), for a rerun whose driver was killed while Tune copied it."""
    import logging
    import os

    log = logging.getLogger("spotfill.fillin.sweep")
    head, tail = SEARCHER_STATE
    base = os.path.basename(searcher_file)
    if not experiment:
        return
    if head not in base or not base.endswith(tail):
        log.warning("Tune saved the searcher to %s, not a %s*%s file: the experiment state is not backed up",
                    searcher_file, head, tail)
        return
    session = base.split(head, 1)[1][:-len(tail)]
    try:
        if back_up(os.path.dirname(searcher_file), session, experiment) is None:
            log.warning("no experiment state for session %s next to %s: not backed up", session, searcher_file)
    except OSError as exc:            # storage unreachable: Tune's own copy still goes, a later save retries
        log.warning("backing up the sweep experiment state to %s failed: %s", experiment, exc)
