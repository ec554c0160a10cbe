"""`megatron-plugin`: the Megatron questions of `accelerate config`, a checked `accelerate launch`, and
Megatron indexed datasets from text.

    megatron-plugin config --config_file megatron_gpt_config.yaml          # asks
    megatron-plugin config --config_file cfg.yaml --tp 2 --num_processes 2 --cpu --non_interactive
    megatron-plugin config --config_file cfg.yaml --tp 2 --context_parallel_size 2 --num_processes 8 \
        --non_interactive                                                  # long sequences: TP2 x CP2 x DP2
    megatron-plugin config --config_file cfg.yaml --tp 8 --num_processes 16 --num_machines 2 \
        --main_process_ip 10.0.0.1 --non_interactive                       # 2 machines x 8 GPUs
    megatron-plugin launch --config_file cfg.yaml train.py --output_dir out # checks the YAML, then launches
    megatron-plugin launch --config_file cfg.yaml --machine_rank 1 train.py # on the second machine
    megatron-plugin preprocess-data --input docs.jsonl --tokenizer tok/ --output_prefix data/my

The YAML is accelerate's own format: `accelerate launch --config_file cfg.yaml` takes it as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from .errors import MegatronPluginConfigError
from .launch_config import MACHINE_KEYS, check_machines
from .placement import tp_warning
from .plugin import (ENV_FIELDS, PARSERS, MegatronLMPlugin, check_compile, check_cpu_support, check_mixed_precision,
                     fp8_from_accelerate, parse_bool, parse_float, parse_int, parse_str)

PRECISIONS = ("no", "fp16", "bf16")
_OFF = object()  # a question not asked takes the answer that turns its feature off (see _off_on_cpu)


@dataclass
class Question:
    key: str
    prompt: str
    default: object
    parse: Callable[[str, str], object]
    ask_if: Callable[[dict], bool] = lambda answers: True
    not_asked: object = _OFF  # the answer when ask_if says no
    required: bool = False  # an empty answer asks again (no default makes sense)
    check: Optional[Callable[[object, dict], None]] = None  # with the answers so far; raises to ask again


def _precision(setting, raw):
    value = str(raw).strip().lower() or "no"
    if value not in PRECISIONS:
        raise MegatronPluginConfigError(setting, raw, f"answer one of {PRECISIONS}")
    return value


def _on_gpu(answers):
    return not answers["cpu"]


def _many_machines(answers):
    return answers["num_machines"] > 1


def _text(setting, raw):
    return str(raw).strip()


def machine_settings(answers: dict) -> dict:
    """The answers as accelerate's keys saying where the processes run (launch_config.MACHINE_KEYS)."""
    backend = answers.get("rdzv_backend") or "static"
    return {"num_processes": answers.get("num_processes"), "num_machines": answers.get("num_machines", 1),
            "machine_rank": answers.get("machine_rank", 0), "main_process_ip": answers.get("main_process_ip"),
            "main_process_port": answers.get("main_process_port"), "rdzv_backend": backend,
            # accelerate hands torchrun a rendezvous endpoint (which c10d needs) only off the "same network"
            "same_network": backend == "static"}


def _check_machine_answer(key):
    def check(value, answers):
        # the keys not answered yet take values that pass, so that only this answer is judged
        so_far = {"main_process_ip": "unanswered", **{k: v for k, v in answers.items() if v is not None}, key: value}
        check_machines(machine_settings(so_far), lambda k: FLAGS.get(k, k))
    return check


# In the order and words of `accelerate config`'s Megatron-LM questions. On CPU the settings that need
# CUDA (pipeline, sequence parallelism, recompute, distributed optimizer, compile) are not asked: off.
QUESTIONS = [
    Question("cpu", "Do you want to run on CPU only (gloo; for development and CI)? [yes/NO]: ", False, parse_bool),
    Question("tp", "What is the Tensor Parallelism degree/size? [1]: ", 1, parse_int),
    Question("sp", "Do you want to enable Sequence Parallelism? [YES/no]: ", True, parse_bool,
             ask_if=lambda a: a["tp"] > 1 and _on_gpu(a)),
    Question("pp", "What is the Pipeline Parallelism degree/size? [1]: ", 1, parse_int, ask_if=_on_gpu),
    # context parallelism (GPT-2 and the Llama family): `--long_context yes` says so (not asked, as the MoE
    # question below: accelerate's questions stay as they are), then the degree is asked; the answer is the
    # --context_parallel_size flag's (one of the other megatron_lm_* keys)
    Question("long_context", "Will each sequence be split over several ranks (context parallelism, for long "
             "sequences; GPT-2 and Llama-family models)? [yes/NO]: ", False, parse_bool, ask_if=lambda a: False,
             not_asked=False),
    Question("context_parallel_size", "What is the Context Parallelism degree/size (each sequence is split over this "
             "many ranks; sequence lengths must be multiples of 2 x it)? [1]: ", 1, parse_int,
             ask_if=lambda a: a["long_context"], not_asked=1),
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): `--moe yes` says so (not asked: accelerate's questions,
    # which every dense run answers, stay as they are), then the expert-parallel degree is asked; the answer is
    # the --expert_model_parallel_size flag's (one of the other megatron_lm_* keys, below)
    Question("moe", "Is the model a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE)? [yes/NO]: ", False,
             parse_bool, ask_if=lambda a: False, not_asked=False),
    Question("expert_model_parallel_size", "What is the Expert Parallelism degree/size (it must divide the number "
             "of experts)? [1]: ", 1, parse_int, ask_if=lambda a: a["moe"], not_asked=1),
    Question("num_micro_batches", "What is the number of micro-batches? [1]: ", 1, parse_int),
    Question("recompute", "Do you want to enable selective activation recomputation? [YES/no]: ", True, parse_bool,
             ask_if=_on_gpu),
    Question("distributed_optimizer", "Do you want to use distributed optimizer which shards optimizer state and "
             "gradients across data parallel ranks? [YES/no]: ", True, parse_bool, ask_if=_on_gpu),
    Question("gradient_clipping", "What is the gradient clipping value based on global L2 Norm (0 to disable)? [1.0]: ",
             1.0, parse_float),
    # accelerate's multi-node questions. On CPU (development and CI) one machine is assumed: the flags set more.
    Question("num_machines", "How many different machines will you use (use more than 1 for multi-node training)? "
             "[1]: ", 1, parse_int, ask_if=_on_gpu, not_asked=1, check=_check_machine_answer("num_machines")),
    Question("machine_rank", "What is the rank of this machine (0 to the number of machines - 1)? [0]: ", 0, parse_int,
             ask_if=_many_machines, not_asked=0, check=_check_machine_answer("machine_rank")),
    Question("main_process_ip", "What is the IP address of the machine that will host the main process? ", None, _text,
             ask_if=_many_machines, not_asked=None, required=True, check=_check_machine_answer("main_process_ip")),
    Question("main_process_port", "What is the port you will use to communicate with the main process? [29500]: ",
             29500, parse_int, ask_if=_many_machines, not_asked=None, check=_check_machine_answer("main_process_port")),
    Question("rdzv_backend", "What rendezvous backend will you use? ('static': a fixed set of machines; 'c10d': "
             "torchrun's elastic rendezvous) [static]: ", "static", parse_str, ask_if=_many_machines,
             not_asked="static", check=_check_machine_answer("rdzv_backend")),
    Question("num_processes", "How many processes (GPUs, or CPU processes) should be used for distributed training, "
             "in total over all machines? [1]: ", 1, parse_int, check=_check_machine_answer("num_processes")),
    Question("mixed_precision", "Do you wish to use FP16 or BF16 (mixed precision)? [NO/fp16/bf16]: ", "no", _precision),
    Question("compile", "Do you want to compile the Megatron layers with torch.compile (Inductor)? [yes/NO]: ", False,
             parse_bool, ask_if=_on_gpu),
]

# plugin / answer names -> the flag a user types
FLAGS = {
    "cpu": "--cpu", "tp": "--tp", "tp_degree": "--tp", "sp": "--sp", "sequence_parallelism": "--sp", "pp": "--pp",
    "pp_degree": "--pp", "num_micro_batches": "--num_micro_batches", "recompute": "--recompute",
    "recompute_activations": "--recompute", "distributed_optimizer": "--distributed_optimizer",
    "use_distributed_optimizer": "--distributed_optimizer", "gradient_clipping": "--gradient_clipping",
    "num_processes": "--num_processes", "mixed_precision": "--mixed_precision", "compile": "--compile",
    "torch_compile": "--compile", "tp_degree*pp_degree": "--tp * --pp", "moe": "--moe",
    "tp_degree*context_parallel_size*pp_degree": "--tp * --context_parallel_size * --pp", "long_context": "--long_context",
    **{key: f"--{key}" for key in MACHINE_KEYS},
}


# The other megatron_lm_* keys of accelerate's config (`accelerate launch` writes each into MEGATRON_LM_*): not
# asked, as `accelerate config` does not ask them, but taken as flags of the same name and written to the YAML.
ASKED = ("tp_degree", "pp_degree", "num_micro_batches", "gradient_clipping", "sequence_parallelism",
         "recompute_activations", "use_distributed_optimizer")
EXTRA_KEYS = {name: (f"megatron_lm_{env.lower()}", PARSERS[kind]) for name, (env, kind, _) in ENV_FIELDS.items()
              if name not in ASKED}
EXTRA_KEYS["recompute_granularity"] = ("megatron_lm_recompute_granularity", parse_str)
FLAGS.update({name: f"--{name}" for name in EXTRA_KEYS})


def _as_flags(err: MegatronPluginConfigError) -> MegatronPluginConfigError:
    return MegatronPluginConfigError(FLAGS.get(err.setting, err.setting), err.value, err.fix)


def ask(question: Question, input_fn=input, print_fn=print, answers=None):
    while True:
        try:
            raw = input_fn(question.prompt).strip()
        except EOFError:
            print_fn("")
            raise MegatronPluginConfigError(
                FLAGS[question.key], None,
                "the input ended before this question was answered: answer it, pass the flag, or add "
                "--non_interactive to take the defaults",
            ) from None
        if raw == "" and question.required:
            print_fn("  an answer is needed")
            continue
        try:
            value = question.default if raw == "" else question.parse(question.key, raw)
            if question.check is not None:
                question.check(value, answers or {})
            return value
        except MegatronPluginConfigError as err:
            print_fn(f"  {err.fix}")


def checked_plugin(settings: dict, world_size: int, cpu: bool, dynamo: Optional[dict], mixed_precision, names: dict):
    """The plugin these settings make, validated as the launched script will validate it (with the world
    size, on CPU or CUDA, compiled or not). `dynamo`: accelerate's torch.compile arguments (backend, mode), None
    for its backend 'no'; the layers compile with them, or with the plugin's torch_compile switch
    (resolve.layer_compile_kwargs). An error names the setting as the user wrote it: `names` maps the plugin's
    names to the questionnaire's flags or the YAML's keys."""
    try:
        plugin = MegatronLMPlugin(**settings)
        plugin.validate(world_size=world_size)
        # accelerate's mixed_precision 'fp8' is this plugin's FP8 around bf16 (Accelerator does the same)
        plugin, mixed_precision = fp8_from_accelerate(plugin, mixed_precision)
        if cpu:
            check_cpu_support(plugin)
        compile_kwargs = dynamo if dynamo is not None else ({} if plugin.torch_compile else None)
        if compile_kwargs is not None:
            check_compile(plugin, compile_kwargs, "cpu" if cpu else "cuda")
        check_mixed_precision(mixed_precision, "cpu" if cpu else "cuda")
    except MegatronPluginConfigError as err:
        if err.setting == "fp8" and "fp8" not in settings:  # it came from mixed_precision
            raise MegatronPluginConfigError(names.get("mixed_precision", "mixed_precision"), "fp8", err.fix) from None
        raise MegatronPluginConfigError(names.get(err.setting, err.setting), err.value, err.fix) from None
    return plugin


def plugin_from_answers(a: dict):
    """The plugin these answers describe, validated as the launched script will validate it."""
    settings = dict(tp_degree=a["tp"], pp_degree=a["pp"], num_micro_batches=a["num_micro_batches"],
                    gradient_clipping=a["gradient_clipping"], sequence_parallelism=a["sp"] and a["tp"] > 1,
                    recompute_activations=a["recompute"], use_distributed_optimizer=a["distributed_optimizer"])
    settings.update(a.get("extra") or {})
    return checked_plugin(settings, a["num_processes"], a["cpu"], {"backend": "inductor"} if a.get("compile") else None,
                          a["mixed_precision"], FLAGS)


def plugin_from_yaml(data: dict, path: str):
    """The plugin the processes `accelerate launch` starts with this config will build (it hands them each
    megatron_lm_<name> as the variable MEGATRON_LM_<NAME>, as text), validated as they will validate it."""
    import torch

    megatron = data.get("megatron_lm_config") or {}
    key = {name: f"megatron_lm_{env.lower()}" for name, (env, _, _) in ENV_FIELDS.items()}
    names = {name: f"megatron_lm_config.{k} in {path}" for name, k in key.items()}
    settings = {name: PARSERS[kind](names[name], str(megatron[key[name]]))
                for name, (_, kind, _) in ENV_FIELDS.items() if megatron.get(key[name]) is not None}
    if megatron.get("megatron_lm_recompute_granularity") is not None:
        settings["recompute_granularity"] = str(megatron["megatron_lm_recompute_granularity"]).strip().lower()
    names |= {"recompute_granularity": f"megatron_lm_config.megatron_lm_recompute_granularity in {path}",
              "tp_degree*pp_degree": f"megatron_lm_tp_degree*megatron_lm_pp_degree in {path}",
              "tp_degree*context_parallel_size*pp_degree":
                  f"megatron_lm_tp_degree*megatron_lm_context_parallel_size*megatron_lm_pp_degree in {path}",
              "num_processes": f"num_processes in {path}", "mixed_precision": f"mixed_precision in {path}",
              "dynamo_backend": f"dynamo_config.dynamo_backend in {path}"}
    dynamo_config = data.get("dynamo_config") or {}
    backend = str(dynamo_config.get("dynamo_backend") or data.get("dynamo_backend") or "no").lower()
    # what accelerate's TorchDynamoPlugin hands torch.compile in the launched processes (its mode decides CUDA
    # graphs, which fp8 and the fused weight gradient refuse: plugin.check_compile)
    dynamo = None if backend == "no" else {"backend": backend, "mode": str(dynamo_config.get("dynamo_mode") or "default")}
    # the launched script runs on CPU when told to, or when there is no GPU
    cpu = bool(data.get("use_cpu")) or not torch.cuda.is_available()
    return checked_plugin(settings, data["num_processes"], cpu, dynamo, data.get("mixed_precision"), names)


def to_yaml_dict(a: dict) -> dict:
    """accelerate's config file schema (what `accelerate config` writes for Megatron-LM)."""
    extra = {"dynamo_config": {"dynamo_backend": "INDUCTOR"}} if a.get("compile") else {}
    return extra | {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MEGATRON_LM",
        "downcast_bf16": "no",
        "main_training_function": "main",
        "megatron_lm_config": {
            "megatron_lm_gradient_clipping": a["gradient_clipping"],
            "megatron_lm_num_micro_batches": a["num_micro_batches"],
            "megatron_lm_pp_degree": a["pp"],
            "megatron_lm_recompute_activations": a["recompute"],
            "megatron_lm_sequence_parallelism": bool(a["sp"] and a["tp"] > 1),
            "megatron_lm_tp_degree": a["tp"],
            "megatron_lm_use_distributed_optimizer": a["distributed_optimizer"],
            **{EXTRA_KEYS[name][0]: value for name, value in (a.get("extra") or {}).items()},
        },
        "mixed_precision": a["mixed_precision"],
        # accelerate's config leaves out the address and port of a single machine (None)
        **{k: v for k, v in machine_settings(a).items() if v is not None},
        "use_cpu": a["cpu"],
    }


def _off_on_cpu(q: Question, answers: dict):
    """The answer of a question that is not asked: off on CPU (where it needs CUDA), else its default."""
    if isinstance(q.default, bool):
        return False
    return 1 if q.key == "pp" else q.default


def run_config(args, input_fn=input, print_fn=print) -> str:
    import yaml

    answers = {}
    for q in QUESTIONS:
        given = getattr(args, q.key)
        if given is not None:
            try:
                answers[q.key] = q.parse(q.key, given) if isinstance(given, str) else given
            except MegatronPluginConfigError as err:
                raise _as_flags(err) from None
        elif not q.ask_if(answers):
            answers[q.key] = _off_on_cpu(q, answers) if q.not_asked is _OFF else q.not_asked
        elif args.non_interactive:
            answers[q.key] = q.default
        else:
            answers[q.key] = ask(q, input_fn, print_fn, answers)
    extra = {}
    for name, (_, parse) in EXTRA_KEYS.items():
        given = getattr(args, name)
        if given is not None:
            try:
                extra[name] = parse(FLAGS[name], given)
            except MegatronPluginConfigError as err:
                raise _as_flags(err) from None
    for name in ("expert_model_parallel_size", "context_parallel_size"):
        if answers[name] != 1:  # asked, or given as the flag (then in extra already)
            extra[name] = answers[name]
    answers["extra"] = extra
    machines = machine_settings(answers)
    check_machines(machines, lambda k: FLAGS.get(k, k))  # flags and defaults skip the questions' checks
    plugin_from_answers(answers)
    warning = tp_warning(answers["tp"], answers["num_processes"] // machines["num_machines"], machines["num_machines"])
    if warning:
        print_fn(f"warning: {warning}")
    path = args.config_file
    from .fs import check_writable

    try:
        try:
            check_writable(os.path.dirname(os.path.abspath(path)), "--config_file")
        except MegatronPluginConfigError as err:
            raise MegatronPluginConfigError("--config_file", path, err.fix) from None
        if os.path.isdir(path):
            raise MegatronPluginConfigError("--config_file", path, "is a folder: name a file, e.g. megatron_config.yaml")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            yaml.safe_dump(to_yaml_dict(answers), f, sort_keys=True)
    except OSError as err:
        raise MegatronPluginConfigError("--config_file", path, f"cannot write it ({err.strerror}): choose another path") from None
    print_fn(f"accelerate configuration saved at {path}")
    return path


def run_launch(args) -> int:
    """Check the config YAML (valid YAML, every key and megatron_lm_* key known to accelerate, the values
    accelerate would choke on, and the Megatron settings as the launched script will check them against the
    process count and the device), then hand everything to `accelerate launch`."""
    from .launch_config import check_config, load_config

    data = load_config(args.config_file)
    given = launch_overrides(args)
    check_config(data, args.config_file, launching=True, given=given, launcher="megatron-plugin launch")
    data = {**data, **given}
    if data["distributed_type"] == "MEGATRON_LM":
        plugin = plugin_from_yaml(data, args.config_file)
        machines = data.get("num_machines", 1)
        warning = tp_warning(plugin.tp_degree, data["num_processes"] // machines, machines)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.config_file,
           *launcher_flags(data, given), *args.script_args]
    os.execv(sys.executable, cmd)
    return 0  # not reached


def launch_overrides(args) -> dict:
    """The machine flags given to `megatron-plugin launch`, which win over the YAML's keys (one YAML for all
    machines, each launched with its own --machine_rank)."""
    out = {}
    for key in MACHINE_KEYS:
        given = getattr(args, key, None)
        if given is None:
            continue
        try:
            out[key] = (parse_bool if key == "same_network" else _text if key == "main_process_ip" else
                        parse_str if key == "rdzv_backend" else parse_int)(f"--{key}", given)
        except MegatronPluginConfigError as err:
            raise MegatronPluginConfigError(f"--{key}", given, err.fix) from None
    return out


def launcher_flags(data: dict, given: dict) -> list:
    """Flags for `accelerate launch`: the machine flags given, and the YAML's rdzv_backend and same_network,
    which accelerate reads from its command line only (the defaults of its flags hide the YAML's values)."""
    flags = []
    for key in MACHINE_KEYS:
        if key == "same_network":
            if data.get(key):
                flags.append("--same_network")  # a switch: off is its default
        elif key in given or (key == "rdzv_backend" and key in data):
            flags += [f"--{key}", str(data[key])]
    return flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-plugin", description=__doc__.splitlines()[0],
                                     epilog=__doc__.partition("\n\n")[2].split("\n\nThe YAML")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="write an accelerate config YAML for a Megatron run")
    cfg.add_argument("--config_file", default="megatron_config.yaml")
    cfg.add_argument("--non_interactive", action="store_true", help="take defaults for anything not given")
    cfg.add_argument("--cpu", nargs="?", const="yes", default=None, help="run on CPU (gloo); bare --cpu means yes")
    cfg.add_argument("--tp", default=None, help="tensor parallel degree")
    cfg.add_argument("--sp", default=None, help="sequence parallelism: yes/no")
    cfg.add_argument("--pp", default=None, help="pipeline parallel degree")
    cfg.add_argument("--long_context", default=None, help="split each sequence over ranks: yes/no (asks the context "
                                                          "parallel degree, --context_parallel_size)")
    cfg.add_argument("--moe", default=None, help="the model is a mixture of experts: yes/no (asks the expert "
                                                 "parallel degree, --expert_model_parallel_size)")
    cfg.add_argument("--num_micro_batches", default=None)
    cfg.add_argument("--recompute", default=None, help="selective activation recomputation: yes/no")
    cfg.add_argument("--distributed_optimizer", default=None, help="yes/no")
    cfg.add_argument("--gradient_clipping", default=None)
    cfg.add_argument("--num_processes", default=None, help="processes in total, over all machines")
    cfg.add_argument("--num_machines", default=None, help="machines running the training (1: this one only)")
    cfg.add_argument("--machine_rank", default=None, help="this machine's rank, 0 to num_machines-1 (the YAML can be "
                                                          "shared: `megatron-plugin launch --machine_rank` overrides it)")
    cfg.add_argument("--main_process_ip", default=None, help="address of the machine of rank 0 (num_machines > 1)")
    cfg.add_argument("--main_process_port", default=None, help="its port (default 29500 with several machines)")
    cfg.add_argument("--rdzv_backend", default=None, help="rendezvous: static (default) or c10d")
    cfg.add_argument("--mixed_precision", default=None, choices=PRECISIONS)
    cfg.add_argument("--compile", default=None, help="compile the Megatron layers with torch.compile (GPU): yes/no")
    more = cfg.add_argument_group("the other megatron_lm_* settings (not asked; MegatronLMPlugin's fields of the same "
                                  "name, written to the YAML as megatron_lm_<name>)")
    for name in EXTRA_KEYS:
        field = MegatronLMPlugin.__dataclass_fields__[name]
        more.add_argument(f"--{name}", default=None, help=field.metadata.get("help"))
    launch = sub.add_parser("launch", help="check a config YAML, then run `accelerate launch` with it")
    launch.add_argument("--config_file", required=True)
    where = launch.add_argument_group("where this machine's processes run (override the YAML's keys of the same name)")
    where.add_argument("--num_processes", default=None, help="processes in total, over all machines")
    where.add_argument("--num_machines", default=None)
    where.add_argument("--machine_rank", default=None, help="this machine's rank (SLURM: $SLURM_NODEID)")
    where.add_argument("--main_process_ip", default=None, help="address of the machine of rank 0")
    where.add_argument("--main_process_port", default=None)
    where.add_argument("--rdzv_backend", default=None, help="static or c10d")
    where.add_argument("--same_network", default=None, help="yes/no")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="the training script and its arguments")
    pre = sub.add_parser("preprocess-data", help="tokenize text into a Megatron indexed dataset (.bin/.idx) for "
                                                 "MegatronLMDummyDataLoader(data_path=...)")
    pre.add_argument("--input", required=True, help="JSON lines (text under --json_key) or text (a document a line)")
    pre.add_argument("--tokenizer", required=True, help="a local folder with an HF tokenizer")
    pre.add_argument("--output_prefix", required=True, help="writes <prefix>_<json_key>_document.bin/.idx")
    pre.add_argument("--json_key", default="text")
    pre.add_argument("--no_append_eod", action="store_true", help="do not end each document with the eos token")
    pre.add_argument("--no_special_tokens", action="store_true", help="tokenize without the tokenizer's BOS etc.")
    return parser


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "config":
            run_config(args)
        elif args.command == "launch":
            if not args.script_args:
                raise MegatronPluginConfigError("script", None, "name the training script after the options")
            return run_launch(args)
        elif args.command == "preprocess-data":
            from .data.preprocess import preprocess_data

            preprocess_data(args.input, args.tokenizer, args.output_prefix, json_key=args.json_key,
                            append_eod=not args.no_append_eod, add_special_tokens=not args.no_special_tokens)
    except MegatronPluginConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
