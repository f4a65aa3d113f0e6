"""The Slurm job's clock (areal_hpc/slurm_job.py): Slurm's time formats, the batch script's
signal lead, and the job's limit and lead as a running job reads them."""
from pathlib import Path

from areal_hpc import slurm_job
from areal_hpc.config import load

ROOT = Path(__file__).resolve().parents[1]
R32 = ROOT / "configs/qwen2_5_32b_math.yaml"


def test_slurm_times_and_the_batch_scripts_lead():
    p = slurm_job.parse_slurm_time
    assert (p("24:00:00"), p("1-00:00:00"), p("1-02"), p("1-02:03"), p("03:04"), p("90")) == \
        (86400, 86400, 93600, 93780, 184, 5400)
    assert p("UNLIMITED") is None and p("INVALID") is None
    for name, lead in (("areal_32b.sh", 9000), ("areal_7b.sh", 1200), ("areal_tiny.sh", 120)):
        text = (ROOT / "slurm" / name).read_text()
        assert slurm_job.lead_from_script(text, ["USR1", "TERM"]) == lead
    assert slurm_job.lead_from_script("#SBATCH --signal=USR2\n", ["USR2"]) == 60   # Slurm's default
    assert slurm_job.lead_from_script("# --signal=B:USR1@5\n", ["USR1"]) is None    # not an #SBATCH line


def test_job_clock_from_slurm(monkeypatch):
    cfg = load(R32, ["topology.gpu=h100"])
    calls = []

    def fake(cmd):
        calls.append(cmd[0])
        return {"squeue": "1-00:00:00\n",
                "scontrol": (ROOT / "slurm/areal_32b.sh").read_text()}[cmd[0]]

    monkeypatch.setattr(slurm_job, "_run", fake)
    assert slurm_job.job_clock(cfg, {"SLURM_JOB_ID": "7"}) == (
        86400.0, "the job's --time (squeue)", 9000.0, "the batch script's --signal")
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": "4600"}
    assert slurm_job.job_clock(cfg, env)[:2] == (3600.0, "SLURM_JOB_END_TIME")
    keys = load(R32, ["checkpoint.time_limit_s=600", "checkpoint.signal_lead_s=60"])
    calls.clear()
    assert slurm_job.job_clock(keys, {"SLURM_JOB_ID": "7"}) == (
        600, "checkpoint.time_limit_s", 60, "checkpoint.signal_lead_s")
    assert calls == []
