"""The CPUs that vLLM's per-worker OpenMP variables name, as a forked worker reads them
(areal_hpc/rollout/vllm_workers.py; the forked workers themselves: test_vllm_engine_tp.py)."""
from areal_hpc.rollout.vllm_workers import omp_cpus


def test_each_of_vllms_openmp_variables_names_the_cpus():
    assert omp_cpus({"OMP_PLACES": "{2,3}", "OMP_PROC_BIND": "true"}) == [2, 3]
    assert omp_cpus({"GOMP_CPU_AFFINITY": "4 5 6"}) == [4, 5, 6]
    assert omp_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[7,1]"}) == [1, 7]


def test_no_binding_names_no_cpus():
    assert omp_cpus({}) == []
    assert omp_cpus({"OMP_PLACES": "cores"}) == []    # an abstract place: left to the runtime
