"""On PYTHONPATH for the ``c10d`` form of tests/integrations/vllm_tp2_run.py only. vLLM's CPU platform
starts its engine core and TP workers with ``spawn``, so a patch made in the launching process
never reaches them; Python imports this module at the start of every process that has the folder
on its path (the run, the engine core, each worker), and it makes vLLM's CPU communicator find
that its ranks share no shared-memory group: it then reduces through torch.distributed (the graph
holds ``_c10d_functional.all_reduce``) whatever the build."""
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

CpuCommunicator._all_group_ranks_share_shm_group_name = lambda self: False
