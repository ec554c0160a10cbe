"""`megatron-plugin config`: the Megatron questions of `accelerate config`, writing a YAML that
`accelerate launch --config_file` takes as it is.

    megatron-plugin config --config_file megatron_gpt_config.yaml          # asks
    megatron-plugin config --config_file cfg.yaml --tp 2 --num_processes 2 --cpu --non_interactive
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import yaml

from .errors import MegatronPluginConfigError
from .plugin import MegatronLMPlugin, parse_bool, parse_float, parse_int

PRECISIONS = ("no", "fp16", "bf16")


@dataclass
class Question:
    key: str
    prompt: str
    default: object
    parse: Callable[[str, str], object]
    ask_if: Callable[[dict], bool] = lambda answers: True


def _precision(setting, raw):
    value = str(raw).strip().lower() or "no"
    if value not in PRECISIONS:
        raise MegatronPluginConfigError(setting, raw, f"answer one of {PRECISIONS}")
    return value


# In the order and words of `accelerate config`'s Megatron-LM questions.
QUESTIONS = [
    Question("cpu", "Do you want to run on CPU only (gloo; for development and CI)? [yes/NO]: ", False, parse_bool),
    Question("tp", "What is the Tensor Parallelism degree/size? [1]: ", 1, parse_int),
    Question("sp", "Do you want to enable Sequence Parallelism? [YES/no]: ", True, parse_bool,
             ask_if=lambda a: a["tp"] > 1),
    Question("pp", "What is the Pipeline Parallelism degree/size? [1]: ", 1, parse_int),
    Question("num_micro_batches", "What is the number of micro-batches? [1]: ", 1, parse_int),
    Question("recompute", "Do you want to enable selective activation recomputation? [YES/no]: ", True, parse_bool),
    Question("distributed_optimizer", "Do you want to use distributed optimizer which shards optimizer state and "
             "gradients across data parallel ranks? [YES/no]: ", True, parse_bool),
    Question("gradient_clipping", "What is the gradient clipping value based on global L2 Norm (0 to disable)? [1.0]: ",
             1.0, parse_float),
    Question("num_processes", "How many processes (GPUs, or CPU processes) should be used for distributed training? [1]: ",
             1, parse_int),
    Question("mixed_precision", "Do you wish to use FP16 or BF16 (mixed precision)? [NO/fp16/bf16]: ", "no", _precision),
    Question("compile", "Do you want to compile the Megatron layers with torch.compile (Inductor)? [yes/NO]: ", False,
             parse_bool, ask_if=lambda a: not a["cpu"]),
]


def ask(question: Question, input_fn=input, print_fn=print):
    while True:
        raw = input_fn(question.prompt).strip()
        if raw == "":
            return question.default
        try:
            return question.parse(question.key, raw)
        except MegatronPluginConfigError as err:
            print_fn(f"  {err.fix}")


def plugin_from_answers(a: dict) -> MegatronLMPlugin:
    """The plugin these answers describe, validated as the launched script will validate it."""
    plugin = MegatronLMPlugin(
        tp_degree=a["tp"], pp_degree=a["pp"], num_micro_batches=a["num_micro_batches"],
        gradient_clipping=a["gradient_clipping"], sequence_parallelism=a["sp"] and a["tp"] > 1,
        recompute_activations=a["recompute"], use_distributed_optimizer=a["distributed_optimizer"],
    )
    plugin.validate(world_size=a["num_processes"])
    if a["cpu"]:
        from .accelerator import check_cpu_support

        check_cpu_support(plugin)
    if a.get("compile"):
        from .accelerator import check_compile

        check_compile(plugin, {"backend": "inductor"}, "cpu" if a["cpu"] else "cuda")
    if a["cpu"] and a["mixed_precision"] == "fp16":
        raise MegatronPluginConfigError("mixed_precision", "fp16", "fp16 needs CUDA; answer 'no' or 'bf16' for CPU")
    return plugin


def to_yaml_dict(a: dict) -> dict:
    """accelerate's config file schema (what `accelerate config` writes for Megatron-LM)."""
    extra = {"dynamo_config": {"dynamo_backend": "INDUCTOR"}} if a.get("compile") else {}
    return extra | {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MEGATRON_LM",
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "megatron_lm_config": {
            "megatron_lm_gradient_clipping": a["gradient_clipping"],
            "megatron_lm_num_micro_batches": a["num_micro_batches"],
            "megatron_lm_pp_degree": a["pp"],
            "megatron_lm_recompute_activations": a["recompute"],
            "megatron_lm_sequence_parallelism": bool(a["sp"] and a["tp"] > 1),
            "megatron_lm_tp_degree": a["tp"],
            "megatron_lm_use_distributed_optimizer": a["distributed_optimizer"],
        },
        "mixed_precision": a["mixed_precision"],
        "num_machines": 1,
        "num_processes": a["num_processes"],
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": a["cpu"],
    }


def run_config(args, input_fn=input, print_fn=print) -> str:
    answers = {}
    for q in QUESTIONS:
        given = getattr(args, q.key)
        if given is not None:
            answers[q.key] = q.parse(q.key, given) if isinstance(given, str) else given
        elif not q.ask_if(answers):
            answers[q.key] = False if isinstance(q.default, bool) else q.default
        elif args.non_interactive:
            answers[q.key] = q.default
        else:
            answers[q.key] = ask(q, input_fn, print_fn)
    plugin_from_answers(answers)
    path = args.config_file
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(to_yaml_dict(answers), f, sort_keys=True)
    print_fn(f"accelerate configuration saved at {path}")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-plugin")
    sub = parser.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="write an accelerate config YAML for a Megatron run")
    cfg.add_argument("--config_file", default="megatron_config.yaml")
    cfg.add_argument("--non_interactive", action="store_true", help="take defaults for anything not given")
    cfg.add_argument("--cpu", default=None, help="run on CPU (gloo): true/false")
    cfg.add_argument("--tp", default=None)
    cfg.add_argument("--sp", default=None, help="sequence parallelism: true/false")
    cfg.add_argument("--pp", default=None)
    cfg.add_argument("--num_micro_batches", default=None)
    cfg.add_argument("--recompute", default=None, help="selective activation recomputation: true/false")
    cfg.add_argument("--distributed_optimizer", default=None, help="true/false")
    cfg.add_argument("--gradient_clipping", default=None)
    cfg.add_argument("--num_processes", default=None)
    cfg.add_argument("--mixed_precision", default=None, choices=PRECISIONS)
    cfg.add_argument("--compile", default=None, help="compile the Megatron layers with torch.compile (GPU): true/false")
    return parser


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "config":
        try:
            run_config(args)
        except MegatronPluginConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
