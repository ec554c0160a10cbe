"""Launched by the tests: print, as JSON, what the plugin and accelerator got from the launch."""
import json

from megatron_plugin import Accelerator

accelerator = Accelerator()
p = accelerator.state.megatron_lm_plugin
if accelerator.is_main_process:
    print("PLUGIN " + json.dumps({
        "tp": p.tp_degree, "pp": p.pp_degree, "sp": p.sequence_parallelism, "num_micro_batches": p.num_micro_batches,
        "recompute": p.recompute_activations, "distributed_optimizer": p.use_distributed_optimizer,
        "gradient_clipping": p.gradient_clipping, "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision, "distributed_type": str(accelerator.distributed_type),
        "main_is_last": accelerator.process_index == accelerator.num_processes - 1,
    }))
