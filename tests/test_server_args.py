"""ServerArgs: CLI generated from the fields (grouped, each default stated once), validation naming
the field, flag combinations."""
import re
import typing
from pathlib import Path

import pytest

from arfusion.fusion.config import FUSION_BACKENDS
from arfusion.server_args import ServerArgs, ServerArgsError
from arfusion.server_args.server_args import GPU_ONLY, GPU_ONLY_MARK, FusionBackend


def test_defaults_and_fusion_flag():
    assert ServerArgs().enable_flashinfer_allreduce_fusion is False
    args = ServerArgs.from_cli(["--tp-size", "2", "--enable-flashinfer-allreduce-fusion", "--allreduce-fusion-backend", "torch"])
    assert (args.tp_size, args.enable_flashinfer_allreduce_fusion, args.allreduce_fusion_backend) == (2, True, "torch")


def _option_helps(help_text: str) -> dict[str, tuple[str, str]]:
    """``--flag`` -> (its group's title, its help text on one line) from ``--help`` output."""
    found, group = {}, ""
    for block in re.split(r"\n(?=  -|\S)", help_text):
        if not block.startswith(" "):
            group = block.split(":")[0]
            continue
        match = re.match(r"  (--[a-z0-9-]+)(?: (?:[A-Z_]+|\{[^}]*\}))?(.*)", block, re.DOTALL)
        if match:
            found[match[1]] = (group, " ".join(match[2].split()))
    return found


def test_help_groups_the_options_by_section_in_field_order():
    helps = _option_helps(ServerArgs.build_parser().format_help())
    groups = [helps["--" + name.replace("_", "-")][0] for name in ServerArgs.model_fields]
    assert list(dict.fromkeys(groups)) == ["model", "parallelism", "fusion", "scheduling", "server"]
    assert helps["--tp-size"][0] == "parallelism" and helps["--shutdown-timeout"][0] == "server"
    assert helps["--enable-flashinfer-allreduce-fusion"][0] == "fusion"
    assert helps["--max-running-requests"][0] == "scheduling" and helps["--model-path"][0] == "model"


def test_every_option_has_its_description_and_one_true_default():
    helps = _option_helps(ServerArgs.build_parser().format_help())
    for name, field in ServerArgs.model_fields.items():
        _, text = helps["--" + name.replace("_", "-")]
        assert " ".join(field.description.split()) in text, name
        assert text.count("(default") == 1, f"--{name}: {text}"
        default = field.default
        if isinstance(default, bool):
            assert text.endswith("(default: off)"), text
        elif default is not None:
            assert text.endswith(f"(default: {default})"), text
    assert "(default: 1)" in helps["--tp-size"][1] and "None" not in "".join(t for _, t in helps.values())


def test_a_tool_extends_the_parser_with_its_own_group():
    parser = ServerArgs.build_parser("tool", description="a tool")
    parser.add_argument_group("benchmark").add_argument("--batch-size", type=int, nargs="+", default=[1, 8],
                                                       help="sizes")
    namespace = parser.parse_args(["--tp-size", "2", "--batch-size", "4"])
    assert ServerArgs.from_namespace(namespace).tp_size == 2 and namespace.batch_size == [4]
    helps = _option_helps(parser.format_help())
    assert helps["--batch-size"][0] == "benchmark" and helps["--batch-size"][1].endswith("sizes (default: [1, 8])")


def test_a_tool_gets_flags_only_for_the_fields_it_uses_and_states_its_own_defaults():
    parser = ServerArgs.build_parser("tool", fields=("tp_size", "allreduce_fusion_backend", "log_level"),
                                     defaults={"allreduce_fusion_backend": ("torch", "as the tool runs on the CPU")})
    helps = _option_helps(parser.format_help())
    assert set(helps) == {"--tp-size", "--allreduce-fusion-backend", "--log-level"}
    assert [helps[f][0] for f in ("--tp-size", "--allreduce-fusion-backend", "--log-level")] == \
        ["parallelism", "fusion", "server"]  # a group per section that has a flag, none for the others
    assert helps["--allreduce-fusion-backend"][1].endswith("(default: torch, as the tool runs on the CPU)")
    assert ServerArgs.from_namespace(parser.parse_args([])).allreduce_fusion_backend == "torch"
    assert ServerArgs.from_namespace(parser.parse_args(["--allreduce-fusion-backend", "flashinfer"])) \
        .allreduce_fusion_backend == "flashinfer"
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "1"])


@pytest.mark.parametrize("fields, defaults", [(("tp_size", "no_such_field"), None), (None, {"no_such_field": (1, "")})])
def test_a_tool_naming_an_unknown_field_is_refused(fields, defaults):
    with pytest.raises(ValueError, match="not ServerArgs fields: no_such_field"):
        ServerArgs.build_parser("tool", fields=fields, defaults=defaults)


@pytest.mark.parametrize("argv, expected", [([], None), (["--max-request-bytes", "4096"], 4096)])
def test_max_request_bytes(argv, expected):
    assert ServerArgs.from_cli(argv).max_request_bytes == expected
    with pytest.raises(ServerArgsError, match="--max-request-bytes"):
        ServerArgs.from_cli(["--max-request-bytes", "0"])


def test_shutdown_timeout():
    assert ServerArgs().shutdown_timeout == 10.0
    assert ServerArgs.from_cli(["--shutdown-timeout", "0.5"]).shutdown_timeout == 0.5
    with pytest.raises(ServerArgsError, match="--shutdown-timeout"):
        ServerArgs.from_cli(["--shutdown-timeout", "-1"])


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tp-size", "0"], "--tp-size"),
        (["--port", "70000"], "--port"),
        (["--allreduce-fusion-max-tokens", "0"], "--allreduce-fusion-max-tokens"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--nnodes", "2"], "dist_init_addr"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "node_rank"),
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "divisible"),
        (["--dist-init-addr", "nohost"], "host:port"),
        (["--device", "cpu", "--enable-flashinfer-allreduce-fusion"], "needs a GPU"),
    ],
)
def test_invalid_values_name_the_field(argv, needle):
    with pytest.raises(ServerArgsError, match=needle):
        ServerArgs.from_cli(argv)


def test_bad_choice_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--allreduce-fusion-backend", "mnnvl"])
    assert "invalid choice" in capsys.readouterr().err


def test_values_are_not_rewritten():
    args = ServerArgs.from_cli(["--enable-flashinfer-allreduce-fusion", "--deterministic"])
    assert args.enable_flashinfer_allreduce_fusion and args.deterministic
    with pytest.raises(Exception):
        args.tp_size = 4  # frozen: one validated config


@pytest.mark.parametrize("flag, value, bad", [("--request-head-timeout", "1.5", "0"), ("--request-body-timeout", "2", "-1"),
                                              ("--max-connections", "8", "0")])
def test_http_client_limits(flag: str, value: str, bad: str):
    field = flag[2:].replace("-", "_")
    assert getattr(ServerArgs.from_cli([flag, value]), field) == type(getattr(ServerArgs(), field))(value)
    with pytest.raises(ServerArgsError, match=flag):
        ServerArgs.from_cli([flag, bad])


def test_help_marks_the_gpu_only_options_and_names_real_paths():
    """GPU-only options say so; the packaged table's directory named in the help exists; the
    TP size is not described as one process per GPU (the CPU runs TP too)."""
    helps = _option_helps(ServerArgs.build_parser().format_help())
    for name in ServerArgs.model_fields:
        flag = "--" + name.replace("_", "-")
        assert helps[flag][1].startswith(GPU_ONLY_MARK) == (name in GPU_ONLY), flag
    assert {"mem_fraction_static", "cuda_graph_max_bs", "disable_cuda_graph"} <= GPU_ONLY
    table_dir = re.search(r"shipped in (\S+?)\)", helps["--allreduce-fusion-table"][1]).group(1)
    assert (Path(__file__).parents[1] / table_dir / "strategy_table.json").is_file(), table_dir
    assert "per GPU" not in helps["--tp-size"][1] and "CPU" in helps["--tp-size"][1]


def test_the_backend_choices_are_the_fusion_ops_backends():
    assert set(typing.get_args(FusionBackend)) == set(FUSION_BACKENDS)
    help_text = ServerArgs.build_parser("tool", fields=("allreduce_fusion_backend",)).format_help()
    assert "{flashinfer,torch}" in help_text
