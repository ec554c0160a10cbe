"""Issue 33's check, on one CPU host playing two machines: two `accelerate launch` commands (num_machines 2,
machine_rank 0 and 1, main_process_ip 127.0.0.1, 2 processes each: world 4) train the README's GPT-2 demo at
TP=2 x DP=2. Their losses are bit for bit those of one machine running the same world-4 layout; a
checkpoint saved across the two resumes bit-identically; and machines given different output folders (as
machines with local disks are) are refused at their first save, on every rank, with the shared-folder error.

Each launch costs about 35 s of the CI machine's 2 cores (four processes importing torch, transformers and
megatron-core), so there are three: the one-machine reference, the two-machine run that saves, and the
two-machine resume whose own saves go to per-machine folders (its losses before that first save are the
resume's)."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.launch import EXAMPLE, ROOT, step_losses

STEPS, SAVE_AT = 4, 2
SHARED_ERROR = "do not see the files rank 0"
# a tiny model and batch: the test is about the launch, not the model
TRAIN_ARGS = ["--max_train_steps", STEPS, "--num_warmup_steps", 1, "--log_every", 1, "--max_eval_batches", 1,
              "--n_layer", 1, "--n_embd", 32, "--n_head", 2]


def _config(path, num_machines, machine_rank, port):
    """The YAML the questionnaire writes for this machine (issue 33: its multi-node answers must run)."""
    cmd = [sys.executable, "-m", "megatron_plugin.cli", "config", "--config_file", str(path), "--non_interactive",
           "--cpu", "--tp", "2", "--num_processes", "4", "--num_machines", str(num_machines)]
    if num_machines > 1:
        cmd += ["--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(path)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_machines(tmp_path, name, per_machine_args, timeout=240):
    """Start one `accelerate launch` per entry of `per_machine_args` (machine_rank = its index) together;
    return [(exit code, output)]. Past `timeout` every launch's process group is killed and the test fails:
    a hang is a failure, not a wait."""
    n = len(per_machine_args)
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MEGATRON_PLUGIN_SHARED_DIR_WAIT_S="0.5", OMP_NUM_THREADS="1")
    procs, logs = [], []
    for rank, args in enumerate(per_machine_args):
        config = _config(tmp_path / f"{name}_machine{rank}.yaml", n, rank, port)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, EXAMPLE, *map(str, args)]
        logs.append(tmp_path / f"{name}_machine{rank}.log")
        with open(logs[-1], "w") as log:  # a file, not a pipe: a launch never blocks on output nobody reads yet
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the workers it started
                proc.wait()
        pytest.fail(f"{name}: launches still running after {timeout}s:\n" +
                    "\n".join(log.read_text()[-3000:] for log in logs))
    return [(proc.returncode, log.read_text()) for proc, log in zip(procs, logs)]


def _ok(name, results):
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"{name}, machine {rank}: exit {code}\n{out[-6000:]}"
    return [out for _, out in results]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from examples.megatron_lm_gpt_pretraining import build_tokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(os.path.join(ROOT, "examples", "data", "corpus.txt"), 256, path)
    return path


def test_two_machines_train_save_resume_and_refuse_unshared_folders(tmp_path, tokenizer_dir):
    common = ["--tokenizer_name", tokenizer_dir, *TRAIN_ARGS]

    (one,) = _ok("one machine", _launch_machines(tmp_path, "one", [common]))
    reference = step_losses(one)
    assert sorted(reference) == list(range(1, STEPS + 1)), one[-3000:]

    shared = tmp_path / "shared"
    args = [*common, "--output_dir", shared, "--checkpointing_steps", SAVE_AT]
    two = _ok("two machines", _launch_machines(tmp_path, "two", [args, args]))
    # accelerate's main process under Megatron is the last rank (rank 3, machine 1): it prints the losses
    assert step_losses(two[1]) == reference, (step_losses(two[1]), reference, two[1][-3000:])
    assert f"checkpoint written to {shared / f'step_{SAVE_AT}'}" in two[1]
    step_dir = shared / f"step_{SAVE_AT}"
    assert (step_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVE_AT)
    assert not [e for e in os.listdir(step_dir) if e.startswith(".")]  # no probe file, no staging folder left

    # resumed from the shared checkpoint, on two machines that are then given their own output folders
    resumed = _launch_machines(tmp_path, "resume", [
        [*common, "--resume_from_checkpoint", step_dir, "--output_dir", tmp_path / f"local{m}",
         "--checkpointing_steps", STEPS] for m in range(2)])
    # the steps after the checkpoint, bit for bit those of the runs that went on without stopping
    assert step_losses(resumed[1][1]) == {s: v for s, v in reference.items() if s > SAVE_AT}, resumed[1][1][-4000:]
    for machine, (code, out) in enumerate(resumed):
        assert code != 0, f"machine {machine} saved into an unshared folder:\n{out[-4000:]}"
        # the clear error, from the machine's ranks (torchrun prefixes a rank's lines with [rankN]). Every rank
        # raises it (test_checkpoint_safety checks each one); here torchrun may stop a machine's second rank
        # as soon as the first has ended, before it prints, so one rank per machine must have said it
        said = [line for line in out.splitlines()
                if line.startswith((f"[rank{2 * machine}]:", f"[rank{2 * machine + 1}]:")) and SHARED_ERROR in line]
        assert said, f"machine {machine} did not report the shared-folder error:\n{out[-6000:]}"
        for line in said:
            for words in ("MegatronPluginConfigError: save_state(output_dir)=", str(tmp_path / f"local{machine}"),
                          "2 of 4 ranks (hosts: ", "(ranks 2, 3)", "must be shared by every machine",
                          "pass a shared path"):
                assert words in line, (words, line)
    # nothing written: the folders (made by rank 0 for its probe, and by the script's main process, rank 3)
    # hold no file
    for machine in range(2):
        assert [p for p, _, files in os.walk(tmp_path / f"local{machine}") if files] == []
