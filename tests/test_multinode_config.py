"""Several machines (issue 33), without training: the questionnaire writes accelerate's multi-node keys
(read back by accelerate's own loader), `megatron-plugin launch` and the launched processes refuse bad
ones naming the key, and the start-up layout report puts megatron-core's groups on their machines."""

import logging
import os

import pytest
import yaml

from megatron_plugin.cli import main
from megatron_plugin.launch_config import check_config, launcher_overrides
from megatron_plugin.placement import machine_names, placement, rank_groups, tp_warning
from tests.errors import check_refusal, refusal
from tests.spawn import run_on_ranks

TWO_MACHINES = ["--non_interactive", "--tp", "2", "--num_processes", "8", "--num_machines", "2", "--machine_rank", "1",
                "--main_process_ip", "10.1.2.3", "--main_process_port", "29601"]


def _config(tmp_path, name, *flags):
    path = tmp_path / name
    return path, main(["config", "--config_file", str(path), *flags])


def test_questionnaire_writes_multinode_keys_accelerate_reads_back(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    path, code = _config(tmp_path, "two.yaml", *TWO_MACHINES)
    assert code == 0
    written = yaml.safe_load(path.read_text())
    expected = {"num_processes": 8, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.1.2.3",
                "main_process_port": 29601, "rdzv_backend": "static", "same_network": True}
    assert {k: written[k] for k in expected} == expected
    loaded = load_config_from_file(str(path))  # what `accelerate launch --config_file` starts from
    assert {k: getattr(loaded, k) for k in expected} == expected
    assert loaded.distributed_type.value == "MEGATRON_LM" and loaded.megatron_lm_config["megatron_lm_tp_degree"] == 2
    check_config(written, str(path), launching=True)

    # c10d rendezvous: accelerate hands torchrun the endpoint only off the "same network"
    path, code = _config(tmp_path, "c10d.yaml", *TWO_MACHINES, "--rdzv_backend", "c10d")
    assert code == 0
    loaded = load_config_from_file(str(path))
    assert (loaded.rdzv_backend, loaded.same_network) == ("c10d", False)

    # CPU, as the two-"machine" CI test runs: the flags set the machines though the questions are not asked
    path, code = _config(tmp_path, "cpu.yaml", "--non_interactive", "--cpu", "--tp", "2", "--num_processes", "4",
                         "--num_machines", "2", "--main_process_ip", "127.0.0.1")
    assert code == 0
    loaded = load_config_from_file(str(path))
    assert (loaded.use_cpu, loaded.num_processes, loaded.num_machines, loaded.machine_rank, loaded.main_process_ip,
            loaded.main_process_port) == (True, 4, 2, 0, "127.0.0.1", 29500)

    # one machine: accelerate's own config leaves the address and port out
    path, code = _config(tmp_path, "one.yaml", "--non_interactive", "--num_processes", "2")
    assert code == 0
    written = yaml.safe_load(path.read_text())
    assert (written["num_machines"], written["machine_rank"], "main_process_ip" in written,
            "main_process_port" in written) == (1, 0, False, False)


def test_questionnaire_interactive_machine_questions(tmp_path):
    """On GPU the machine questions come after clipping; a bad answer is asked again."""
    from megatron_plugin.cli import run_config, build_parser

    answers = iter(["no", "2", "", "1", "1", "", "", "", "2", "5", "1", "", "node0.cluster", "", "c10d", "3", "4", "bf16", ""])
    printed = []
    args = build_parser().parse_args(["config", "--config_file", str(tmp_path / "i.yaml")])
    run_config(args, input_fn=lambda prompt: (printed.append(prompt), next(answers))[1], print_fn=printed.append)
    data = yaml.safe_load((tmp_path / "i.yaml").read_text())
    assert {k: data[k] for k in ("num_machines", "machine_rank", "main_process_ip", "main_process_port",
                                 "rdzv_backend", "same_network", "num_processes")} == {
        "num_machines": 2, "machine_rank": 1, "main_process_ip": "node0.cluster", "main_process_port": 29500,
        "rdzv_backend": "c10d", "same_network": False, "num_processes": 4}
    text = "\n".join(map(str, printed))
    assert "machine ranks run from 0 to num_machines-1=1" in text and "an answer is needed" in text
    assert "use a multiple of num_machines=2, e.g. 4" in text
    assert next(answers, "done") == "done"


# flags -> (the flag the error names, words of the value and the fix)
BAD_FLAGS = {
    "no_ip": (["--num_machines", "2", "--num_processes", "2"], "--main_process_ip", ["=None", "machine of rank 0",
                                                                                    "scontrol show hostnames"]),
    "uneven": (["--num_machines", "2", "--main_process_ip", "h", "--num_processes", "3"], "--num_processes",
               ["=3", "multiple of num_machines=2", "e.g. 4"]),
    "rank_high": (["--num_machines", "2", "--main_process_ip", "h", "--num_processes", "2", "--machine_rank", "2"],
                  "--machine_rank", ["=2", "0 to num_machines-1=1", "SLURM_NODEID"]),
    "rank_negative": (["--machine_rank", "-1"], "--machine_rank", ["=-1", "whole number from 0"]),
    "machines_zero": (["--num_machines", "0"], "--num_machines", ["=0", ">= 1"]),
    "port_big": (["--main_process_port", "65536"], "--main_process_port", ["=65536", "1 to 65535"]),
    "port_text": (["--main_process_port", "http"], "--main_process_port", ["'http'", "whole number"]),
    "port_zero_many": (["--num_machines", "2", "--main_process_ip", "h", "--num_processes", "2",
                        "--main_process_port", "0"], "--main_process_port", ["=0", "would not meet"]),
    "ip_with_port": (["--num_machines", "2", "--main_process_ip", "http://h:29500", "--num_processes", "2"],
                     "--main_process_ip", ["'http://h:29500'", "bare address"]),
    "rdzv": (["--rdzv_backend", "c10"], "--rdzv_backend", ["'c10'", "did you mean 'c10d'"]),
    "layout": (["--num_machines", "2", "--main_process_ip", "h", "--num_processes", "6", "--tp", "4"], "--tp * --pp",
               ["world size 6", "multiple of 4"]),
}


@pytest.mark.parametrize("name", sorted(BAD_FLAGS))
def test_questionnaire_refuses_bad_machine_flags(name, tmp_path, capsys):
    flags, setting, words = BAD_FLAGS[name]
    path = tmp_path / "bad.yaml"
    capsys.readouterr()
    assert main(["config", "--config_file", str(path), "--non_interactive", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {setting}="), err
    for w in words:
        assert w in err, (w, err)
    assert not path.exists()


def _yaml(**keys):
    base = {"distributed_type": "MEGATRON_LM", "use_cpu": True, "num_processes": 4,
            "megatron_lm_config": {"megatron_lm_tp_degree": 2}}
    return {**base, **keys}


# YAML keys -> (the key the error names, words)
BAD_YAML = {
    "no_ip": (dict(num_machines=2), "main_process_ip", ["=None"]),
    "uneven": (dict(num_machines=3, main_process_ip="h"), "num_processes", ["=4", "multiple of num_machines=3", "e.g. 6"]),
    "rank": (dict(num_machines=2, main_process_ip="h", machine_rank=2), "machine_rank", ["=2"]),
    "rank_text": (dict(machine_rank="one"), "machine_rank", ["'one'"]),
    "port": (dict(main_process_port=-5), "main_process_port", ["=-5"]),
    "port_text": (dict(main_process_port="29500a"), "main_process_port", ["'29500a'"]),
    "rdzv": (dict(rdzv_backend="etcd3"), "rdzv_backend", ["'etcd3'"]),
    "c10d_same_network": (dict(num_machines=2, main_process_ip="h", rdzv_backend="c10d", same_network=True),
                          "rdzv_backend", ["'c10d'", "same_network: false"]),
    "same_network_text": (dict(same_network="yes please"), "same_network", ["'yes please'"]),
}


@pytest.mark.parametrize("name", sorted(BAD_YAML))
def test_check_config_refuses_bad_machine_keys(name):
    keys, key, words = BAD_YAML[name]
    check_refusal(refusal(check_config, _yaml(**keys), "cfg.yaml", launching=True), f"{key} in cfg.yaml", *words,
                  exact=True, where=name)


def test_launcher_flags_win_over_the_yaml_and_are_named_in_errors():
    """One YAML for every machine, each launched with its own --machine_rank: the launched processes check
    what the launcher's command line made of it."""
    argv = ["/usr/bin/python3", "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "--machine-rank", "1",
            "--main_process_ip=10.0.0.9", "--rdzv_backend", "c10d", "train.py", "--machine_rank", "7"]
    given = launcher_overrides(argv)
    assert given == {"machine_rank": 1, "main_process_ip": "10.0.0.9", "rdzv_backend": "c10d", "same_network": False}
    assert launcher_overrides(["python", "train.py", "--machine_rank", "3"]) == {}  # not a launcher
    assert launcher_overrides(["/venv/bin/accelerate", "launch", "--num_machines", "2", "t.py"])["num_machines"] == 2
    data = _yaml(num_machines=2, machine_rank=0)  # the shared YAML: no address, rank 0
    check_refusal(refusal(check_config, data, "c.yaml", given={"machine_rank": 1}), "main_process_ip in c.yaml", exact=True)
    assert refusal(check_config, data, "c.yaml", given=given) is None
    check_refusal(refusal(check_config, data, "c.yaml", given={**given, "machine_rank": 2}),
                  "--machine_rank of accelerate launch", "=2", exact=True)


def test_megatron_plugin_launch_passes_machine_flags_to_accelerate(tmp_path, monkeypatch, capsys):
    from megatron_plugin import cli

    launched = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, cmd: launched.append(cmd))
    path, code = _config(tmp_path, "two.yaml", "--non_interactive", "--cpu", "--tp", "2", "--num_processes", "4",
                         "--num_machines", "2", "--main_process_ip", "127.0.0.1", "--rdzv_backend", "c10d")
    assert code == 0
    assert cli.main(["launch", "--config_file", str(path), "--machine_rank", "1", "train.py", "--lr", "1"]) == 0
    cmd = launched[-1]
    # accelerate reads rdzv_backend / same_network from its command line only: the YAML's are passed on
    assert cmd[cmd.index("--config_file") + 1:] == [str(path), "--machine_rank", "1", "--rdzv_backend", "c10d",
                                                    "train.py", "--lr", "1"]
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(cmd[cmd.index("--config_file"):]))
    assert (args.num_processes, args.num_machines, args.machine_rank, args.main_process_ip, args.main_process_port,
            args.rdzv_backend, args.same_network) == (4, 2, 1, "127.0.0.1", 29500, "c10d", False)
    # a bad override is refused before anything starts, naming the flag
    capsys.readouterr()
    assert cli.main(["launch", "--config_file", str(path), "--machine_rank", "2", "train.py"]) == 2
    assert capsys.readouterr().err.startswith("error: --machine_rank of megatron-plugin launch=2"), launched
    assert len(launched) == 1
    # TP across machines is allowed, with a warning
    path, code = _config(tmp_path, "tp4.yaml", "--non_interactive", "--cpu", "--tp", "4", "--num_processes", "4",
                         "--num_machines", "2", "--main_process_ip", "127.0.0.1")
    assert code == 0 and "warning: tp_degree=4 does not divide the 2 processes per machine" in capsys.readouterr().out
    assert cli.main(["launch", "--config_file", str(path), "train.py"]) == 0
    assert "warning: tp_degree=4" in capsys.readouterr().err and len(launched) == 2


# -- megatron-core's groups on the machines ----------------------------------------------------------
def test_rank_groups_are_megatron_cores():
    from megatron.core.parallel_state import RankGenerator

    for tp, cp, pp, dp in [(1, 1, 1, 4), (2, 1, 1, 2), (2, 1, 2, 2), (4, 1, 2, 3), (2, 2, 2, 2), (1, 2, 3, 2)]:
        theirs = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        ours = rank_groups(tp * cp * pp * dp, tp, pp, cp)
        for kind in ("tp", "cp", "dp", "pp"):
            assert ours[kind] == theirs.get_ranks(kind), (tp, cp, pp, dp, kind)
    # the expert grid (parallel_state's expert RankGenerator: etp x ep x expert-dp x pp)
    for world, tp, pp, ep, etp in [(4, 1, 1, 2, None), (4, 2, 1, 2, None), (8, 2, 2, 2, 1), (16, 2, 2, 4, 1)]:
        etp_ = etp or tp
        theirs = RankGenerator(tp=etp_, ep=ep, dp=world // (etp_ * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        assert rank_groups(world, tp, pp, 1, ep, etp)["ep"] == theirs.get_ranks("ep"), (world, tp, pp, ep, etp)
    assert "ep" not in rank_groups(4, 2, 1)
    where = placement(4, 1, 1, 1, ["a", "a", "b", "b"], ep=2)
    assert where.groups["ep"] == [[0, 1], [2, 3]] and where.spanning["ep"] == 0
    assert "  EP groups (2 of 2, all within one machine): [0-1@a]  [2-3@b]" in where.table(1, 1, 1).splitlines()


def test_placement_two_hosts_tp_stays_on_a_host():
    where = placement(4, 2, 1, 1, ["a", "a", "b", "b"])
    assert where.groups == {"tp": [[0, 1], [2, 3]], "cp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]],
                            "pp": [[0], [1], [2], [3]]}
    assert where.spanning == {"tp": 0, "cp": 0, "dp": 2, "pp": 0} and where.warning is None
    assert where.table(2, 1, 1).splitlines() == [
        "Megatron layout: 4 processes on 2 machine(s); TP=2 x CP=1 x PP=1 x DP=2 (megatron-core rank order tp-cp-dp-pp)",
        "  machines (ranks): a: 0-1 | b: 2-3",
        "  TP groups (2 of 2, all within one machine): [0-1@a]  [2-3@b]",
        "  DP groups (2 of 2, 2 spanning machines): [0@a 2@b]  [1@a 3@b]",
    ]
    # PP over two hosts of 4: each TP pair on one host, the stages on different hosts
    where = placement(8, 2, 2, 1, ["a"] * 4 + ["b"] * 4)
    assert where.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and where.spanning["tp"] == 0
    assert where.spanning["pp"] == 4 and where.spanning["dp"] == 0 and where.warning is None


def test_placement_tp_across_hosts_warns():
    where = placement(4, 4, 1, 1, ["a", "a", "b", "b"])
    assert where.groups["tp"] == [[0, 1, 2, 3]] and where.spanning["tp"] == 1
    assert where.warning == tp_warning(4, 2, 2)
    assert "tp_degree=4 does not divide the 2 processes per machine" in where.warning and "e.g. 2" in where.warning
    assert "TP groups (1 of 4, 1 spanning machines): [0-1@a 2-3@b]" in where.table(4, 1, 1)
    # ranks not numbered machine by machine: TP crosses though tp divides the processes per machine
    where = placement(4, 2, 1, 1, ["a", "b", "a", "b"])
    assert where.spanning["tp"] == 2 and "2 of 2 tensor-parallel groups span machines" in where.warning
    assert tp_warning(2, 8, 2) is None and tp_warning(3, 8, 1) is None and tp_warning(3, 8, 2) is not None


def test_machine_names_tell_apart_launches_on_one_host():
    assert machine_names(["h", "h", "h", "h"], [0, 0, 1, 1]) == ["h#0", "h#0", "h#1", "h#1"]
    assert machine_names(["a", "a", "b", "b"], [0, 0, 1, 1]) == ["a", "a", "b", "b"]
    assert machine_names(["a", "a"], [None, None]) == ["a", "a"]


def _report_worker(tp):
    """Each process plays its own machine (torchrun's GROUP_RANK) on this host."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize

    import torch.distributed as dist

    os.environ["GROUP_RANK"] = os.environ["RANK"]
    records = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("megatron_plugin.engine.distributed")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        initialize(MegatronLMPlugin(tp_degree=tp))
        return [(r.levelname, r.getMessage()) for r in records], dist.get_rank()
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def test_layout_report_at_start_once_on_rank_0():
    import socket

    host = socket.gethostname()
    (logged0, r0), (logged1, r1) = run_on_ranks(_report_worker, 2, 1)
    assert (r0, r1, logged1) == (0, 1, [])
    assert logged0 == [("INFO", "\n".join([
        "Megatron layout: 2 processes on 2 machine(s); TP=1 x CP=1 x PP=1 x DP=2 (megatron-core rank order tp-cp-dp-pp)",
        f"  machines (ranks): {host}#0: 0 | {host}#1: 1",
        f"  DP groups (1 of 2, 1 spanning machines): [0@{host}#0 1@{host}#1]",
    ]))]
    (logged0, _), (logged1, _) = run_on_ranks(_report_worker, 2, 2)
    assert [level for level, _ in logged0] == ["INFO", "WARNING"] and logged1 == []
    assert logged0[1][1] == tp_warning(2, 1, 2)
    assert run_on_ranks(_report_worker, 1, 1) == [([], 0)]  # a world of one: no gathering, no report


def _timeout_seen_by_megatron_groups():
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs
    from torch.utils.data import DataLoader

    import megatron_plugin.build as build
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.models import tiny_gpt2
    from tests.training import optimizer_for, token_dataset

    seen, start = [], build.start
    build.start = lambda *a, **k: (seen.append(k.get("timeout_minutes")), start(*a, **k))[1]
    try:
        model = tiny_gpt2()
        opt = optimizer_for(model)
        acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(),
                          kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=61))])
        acc.prepare(model, opt, MegatronLMDummyScheduler(opt, total_num_steps=2),
                    DataLoader(token_dataset(8, 1000), batch_size=4))
    finally:
        build.start = start
    return seen


def test_init_process_group_timeout_reaches_megatron_groups():
    """accelerate's InitProcessGroupKwargs(timeout=...) bounds megatron-core's TP/PP/DP groups too."""
    from tests.spawn import run_on_ranks

    assert run_on_ranks(_timeout_seen_by_megatron_groups, 1) == [[61]]


def test_questionnaire_asks_the_expert_parallel_degree_for_moe_models(tmp_path):
    """`--moe yes` asks the expert-parallel degree; its answer is written as accelerate's
    megatron_lm_expert_model_parallel_size and checked against the process count like the other degrees."""
    from megatron_plugin.cli import build_parser, run_config

    answers = iter(["yes", "1", "2", "", "", "4", ""])  # cpu, tp, EP, micro-batches, clip, procs, precision
    printed = []
    args = build_parser().parse_args(["config", "--config_file", str(tmp_path / "moe.yaml"), "--moe", "yes"])
    run_config(args, input_fn=lambda prompt: (printed.append(prompt), next(answers))[1], print_fn=printed.append)
    assert next(answers, "done") == "done"
    assert any("Expert Parallelism" in str(p) for p in printed)
    data = yaml.safe_load((tmp_path / "moe.yaml").read_text())
    assert data["megatron_lm_config"]["megatron_lm_expert_model_parallel_size"] == 2
    # a dense model is not asked, and writes no expert key
    answers = iter(["yes", "1", "", "", "2", ""])
    printed.clear()
    args = build_parser().parse_args(["config", "--config_file", str(tmp_path / "dense.yaml")])
    run_config(args, input_fn=lambda prompt: (printed.append(prompt), next(answers))[1], print_fn=printed.append)
    assert not any("Expert Parallelism" in str(p) for p in printed)
    assert "megatron_lm_expert_model_parallel_size" not in yaml.safe_load((tmp_path / "dense.yaml").read_text())[
        "megatron_lm_config"]
    # EP 2 on 3 processes: refused under the flag's name before anything is written
    path, code = _config(tmp_path, "bad.yaml", "--non_interactive", "--cpu", "--num_processes", "3", "--moe", "yes",
                         "--expert_model_parallel_size", "2")
    assert code == 2 and not path.exists()
