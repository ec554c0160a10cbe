"""Run commands the way a user does (`accelerate launch ...`) and read what they print."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "megatron_lm_gpt_pretraining.py")
CONFIGS = os.path.join(ROOT, "examples", "configs")


def accelerate_launch(config, script, *args, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, script, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout + proc.stderr


def step_losses(output):
    """{step: loss text} from the example's `--log_every` lines (text, so equality is bit-exact)."""
    out = {}
    for line in output.splitlines():
        idx = line.find("step ")
        if idx >= 0 and " loss " in line[idx:]:
            parts = line[idx:].split()
            if len(parts) >= 4 and parts[1].isdigit():
                out[int(parts[1])] = parts[3]
    return out
