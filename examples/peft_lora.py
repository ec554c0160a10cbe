"""`--lora_r` for the post-training examples: the HF model wrapped with peft's LoRA before `prepare`, as an HF
script does. Only the adapters train (no gradient, master copy or optimizer state for the frozen base);
`save_model` then writes the PEFT adapter folder, which `PeftModel.from_pretrained(base, folder)` loads."""


def add_lora_args(parser):
    parser.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 (default): full fine-tuning")
    parser.add_argument("--lora_alpha", type=float, default=None, help="LoRA alpha; default: 2 x lora_r")
    parser.add_argument("--lora_dropout", type=float, default=0.0)
    parser.add_argument("--lora_target_modules", default="q_proj,k_proj,v_proj,o_proj",
                        help="comma-separated HF module names (GPT-2: c_attn,c_proj,c_fc)")


def with_lora(model, args):
    """The model as peft's PeftModel with LoRA adapters when `--lora_r` is set; else the model itself."""
    if not args.lora_r:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r, lora_dropout=args.lora_dropout,
                        target_modules=[t.strip() for t in args.lora_target_modules.split(",") if t.strip()],
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)
