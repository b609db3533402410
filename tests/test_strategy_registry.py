"""The strategy registry (`fusion.strategies`): every backend class declares its strategy, the
lists derived from the registry are consistent, the policy names no strategy, and a new strategy
is its backend file, one registry line (with its import) and one `Strategy` member, nothing else.

The last claim is shown on a copy of the packages: the test adds a throwaway CPU strategy to
the copy exactly as a contributor would (a new file in fusion/backends/, the enum member and the
registry line, each an insertion of one line that the test checks) and runs it on two gloo
ranks. The copy is the proof that no other edit is needed: every view derived at import time
(the cost model, the fallback order, the table's strategy names) is derived afresh there.
"""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from arfusion.fusion.backends.base import Made
from arfusion.fusion.config import FusionConfig
from arfusion.fusion.options import FUSION_BACKENDS
from arfusion.fusion.strategies import FALLBACK, FALLBACK_ORDER, REGISTRY, offered
from arfusion.fusion.strategy import Strategy

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[1]


def test_every_strategy_has_one_registered_backend_class():
    assert [cls.strategy for cls in REGISTRY] == list(Strategy), "one class per member, in the enum's order"


@pytest.mark.parametrize("cls", REGISTRY, ids=lambda cls: cls.strategy.value)
def test_each_class_declares_how_it_runs_and_who_offers_it(cls):
    assert cls.__doc__ and cls.__doc__.strip().splitlines()[0], "the docstring's first line is the summary"
    assert cls.options and set(cls.options) <= set(FUSION_BACKENDS)
    assert (cls.fallback_rank is None) or not cls.fallback, "the fallback is not among the fused strategies"


def test_one_fallback_that_every_option_offers_and_distinct_ranks():
    assert [cls.strategy for cls in REGISTRY if cls.fallback] == [FALLBACK]
    assert set(next(cls for cls in REGISTRY if cls.fallback).options) == set(FUSION_BACKENDS)
    ranks = [cls.fallback_rank for cls in REGISTRY if cls.fallback_rank is not None]
    assert len(ranks) == len(set(ranks)) == len(FALLBACK_ORDER)


@pytest.mark.parametrize("option", FUSION_BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_option_builds_the_fallback_and_one_primary_backend(option, deterministic, world_size):
    classes = offered(FusionConfig(backend=option, deterministic=deterministic), world_size)
    assert FALLBACK in [cls.strategy for cls in classes]
    assert len([cls for cls in classes if cls.role(deterministic) is Made.PRIMARY]) == 1


@pytest.mark.parametrize("module", ["fusion/dispatch/decision.py", "fusion/dispatch/rule.py"])
def test_the_policy_names_no_strategy(module):
    source = (ROOT / module).read_text()
    # a member's name anywhere, or its value as a word (not the module `torch`: "import torch", "torch.")
    named = [s for s in Strategy if re.search(rf"\b{s.name}\b|(?<!import )\b{s.value}\b(?!\.)", source)]
    assert named == [], f"{module} names {named}: the backend classes declare what the policy reads"


def test_the_config_imports_no_backend():
    """`fusion.config` reads the option names from `fusion.options`, which imports nothing of arfusion."""
    def arfusion_imports(module: str) -> set[str]:
        tree = ast.parse((ROOT / module).read_text())
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module and node.module.startswith("arfusion")}

    assert arfusion_imports("fusion/config.py") == {"arfusion.fusion.options"}
    assert arfusion_imports("fusion/options.py") == set()


# ---- a throwaway strategy, added to a copy of the packages as a contributor adds one

NEW_BACKEND = '''"""A CPU strategy made on demand: every rank's partial sums gathered and added in rank order,
then the reference add + RMSNorm (`fusion.reference`)."""
from __future__ import annotations

from typing import Optional

import torch

from arfusion.fusion import reference
from arfusion.fusion.backends.base import NO_ROWS, Backend, Made, Rows, quantized
from arfusion.fusion.backends.deterministic import gather_parts
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.options import TORCH
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy


class GatherThenNormBackend(Backend):
    """all-gather the partial sums, add them in rank order, then add + RMSNorm"""

    strategy = Strategy.GATHER_THEN_NORM
    options = (TORCH,)
    made = Made.ON_DEMAND
    cost = {2: (1.0, 0.0, 0.0)}  # cheaper than the fallback at TP2: the rule picks it

    def __init__(self, group: TensorParallelGroup) -> None:
        super().__init__(group)
        self.max_tokens = 0

    def _ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        self.max_tokens = max(self.max_tokens, max_tokens)
        return True

    def rows(self) -> Rows:
        return Rows(1, self.max_tokens) if self.max_tokens else NO_ROWS

    @property
    def capacity(self) -> int:
        return self.max_tokens

    def _destroy(self) -> None:
        self.max_tokens = 0

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
            quant: Optional[Quant] = None) -> FusedOutput:
        summed = reference.rank_order_sum(list(gather_parts(self.group, x)))
        out = FusedOutput(*reference.add_rms_norm(summed, residual, weight, eps))
        return out if quant is None else quantized(out, quant)
'''

# (file, the line before which one line goes, the line): the contributor's whole edit outside the new file
EDITS = [
    ("fusion/strategy.py", '    TORCH = "torch"\n', '    GATHER_THEN_NORM = "gather_then_norm"\n'),
    ("fusion/strategies.py", "from arfusion.fusion.backends.lamport_one_shot import LamportOneShotBackend\n",
     "from arfusion.fusion.backends.gather_then_norm import GatherThenNormBackend\n"),
    ("fusion/strategies.py", "    TorchBackend,\n", "    GatherThenNormBackend,\n"),
]

SCRIPT = '''"""Two gloo ranks, the torch option: the new strategy picked by the built-in rule (no table for
a CPU: the packaged one has none, and nothing is tuned at start-up since no backend of the op
declares it), then by a measured table; one reduction through RMSNorm each time."""
import json
import sys

import torch

HIDDEN, EPS, TOKENS = 64, 1e-6, 4


def inputs(rank):
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank))


def worker(rank, world_size, table_path, cache_dir):
    import arfusion.fusion as fusion
    from arfusion.fusion import AllReduceFusion, FusionConfig, PartialSum, reference
    from arfusion.layers.layernorm import RMSNorm
    from arfusion.layers.parallel_state import get_tp_group

    out = {"fusion": fusion.__file__}
    shared = torch.Generator().manual_seed(99)
    residual = torch.randn(TOKENS, HIDDEN, generator=shared)
    norm = RMSNorm(HIDDEN, EPS)
    norm.weight.data = 1.0 + 0.1 * torch.randn(HIDDEN, generator=shared)
    expected = reference.add_rms_norm(sum(inputs(r) for r in range(world_size)), residual, norm.weight.data, EPS)
    for name, path in (("rule", None), ("table", table_path)):
        config = FusionConfig(enabled=True, backend="torch", max_tokens=64, table_path=path, tuning_cache_dir=cache_dir)
        op = AllReduceFusion(get_tp_group(), config, HIDDEN, torch.float32)
        op.setup()
        picks = {t: op.strategy(0, t).value for t in (1, 4, 5, 64)}
        with torch.inference_mode():
            normed, summed = norm(PartialSum(pending=inputs(rank), layer_id=0, op=op), residual.clone())
        error = max((normed - expected[0]).abs().max().item(), (summed - expected[1]).abs().max().item())
        out[name] = {"picks": picks, "error": error, "status": op.status()}
        op.destroy()
    return out


if __name__ == "__main__":
    from tests.dist_utils import run_distributed

    print(json.dumps(run_distributed(worker, args=tuple(sys.argv[1:3]), timeout_s=240)))
'''


def test_a_new_strategy_needs_its_file_one_registry_line_and_one_enum_member(tmp_path: Path):
    copy = tmp_path / "tree" / "arfusion"
    for package in ("fusion", "layers"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "fusion/backends/gather_then_norm.py").write_text(NEW_BACKEND)
    for module, before, line in EDITS:
        path = copy / module
        source = path.read_text()
        assert source.count(before) == 1, f"{module}: the anchor of the one-line edit moved"
        path.write_text(source.replace(before, line + before))
    table = tmp_path / "table.json"  # TP2 on this CPU: the new strategy fastest up to 4 tokens, the fallback beyond
    table.write_text(json.dumps({"version": 2, "entries": [{
        "gpu": "cpu", "world_size": 2, "hidden": 64, "dtype": "float32",
        "timings_us": {"4": {"nccl": 50.0, "gather_then_norm": 10.0}, "64": {"nccl": 10.0, "gather_then_norm": 50.0}}}]}))
    script = tmp_path / "new_strategy.py"
    script.write_text(SCRIPT)
    cache_dir = tmp_path / "tuning_cache"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'tree'}{os.pathsep}{ROOT}"}
    result = subprocess.run([sys.executable, str(script), str(table), str(cache_dir)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = json.loads(result.stdout.strip().splitlines()[-1])
    assert ranks[0]["fusion"].startswith(str(copy)), "the ranks ran the copy with the new strategy"
    for out in ranks:
        rule, measured = out["rule"], out["table"]
        assert rule["picks"] == {"1": "gather_then_norm", "4": "gather_then_norm", "5": "gather_then_norm",
                                 "64": "gather_then_norm"}, "the built-in rule prices it (its declared cost)"
        assert measured["picks"] == {"1": "gather_then_norm", "4": "gather_then_norm", "5": "nccl", "64": "nccl"}
        for run in (rule, measured):
            assert run["error"] < 1e-5
            # /get_server_info's "fusion" is this status (engine/server/rank0.py)
            assert run["status"]["backend_tokens"] == {"gather_then_norm": 64, "torch": 64}
            assert run["status"]["reductions"] == {"gather_then_norm": 1}
        assert rule["status"]["measured_strategy_table"] is False and measured["status"]["measured_strategy_table"]
    assert not cache_dir.exists(), "made on demand, it does not turn start-up tuning on"
