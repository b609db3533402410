"""ServerArgs: CLI generated from the fields, validation naming the field, flag combinations."""
import pytest

from server_args import ServerArgs, ServerArgsError


def test_defaults_and_fusion_flag():
    assert ServerArgs().enable_flashinfer_allreduce_fusion is False
    args = ServerArgs.from_cli(["--tp-size", "2", "--enable-flashinfer-allreduce-fusion", "--allreduce-fusion-backend", "torch"])
    assert (args.tp_size, args.enable_flashinfer_allreduce_fusion, args.allreduce_fusion_backend) == (2, True, "torch")


def test_every_field_has_a_flag_with_its_description_as_help():
    help_text = ServerArgs.build_parser().format_help()
    for name, field in ServerArgs.model_fields.items():
        assert "--" + name.replace("_", "-") in help_text
        assert field.description and field.description.split()[0] in help_text


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
