"""Post-training (DESIGN.md section 12): supervised fine-tuning data, its dataset and its masked loss.

    sft_data      chat templates, one example -> ids + loss mask, packing rows (pure; tools/preprocess_sft_data.py)
    sft_dataset   the two aligned indexed datasets -> train/valid/test rows (finetune_gpt.py)
    common        what the methods share: rows -> model inputs (masks and positions per packed example),
                  preference pairs, the group reductions, the eval-mode switch, the frozen reference policy
    sft_loss      SFT: the step's token-weighted loss
    dpo           Direct Preference Optimization on preference pairs: the sigmoid loss
    reward        the reward model's pair losses (last token, DeepSpeed-Chat's divergence span) and metrics
    rlhf          RLHF step 3: experience from the actor being trained, the per-micro-batch PPO and GRPO steps
    rlhf_loss     RLHF step 3's losses: PPO as DeepSpeed-Chat computes it, GRPO's advantages and reductions as TRL
    ema           RLHF step 3's EMA actor (DeepSpeed-Chat's moving_average), saved as an actor checkpoint

The drivers the entry points call (imported by module, not here: the light tools import this package):
    start         what every driver shares: flag checks, start-or-resume, the model providers, preference data
    sft_driver    finetune_gpt.py: SFT and DPO on pretraining's loop (samples: its --sample-every)
    reward_driver train_reward_model.py: the reward model on pretraining's loop
    rlhf_driver   train_rlhf.py: the PPO/GRPO loop (rlhf_flags: its command line)
"""
from .sft_data import (DEFAULT_TEMPLATE, TEMPLATES, ChatTemplate, ExampleError, assemble_row, checked_messages,
                       encode_example, encode_prompt, pack_examples, parse_example, parse_preference, truncate_example)
from .sft_dataset import (PreferenceDataset, SFTDataError, SFTDataset, build_preference_datasets, build_sft_datasets,
                          open_sft_files, output_prefixes)
from . import common, dpo, ema, reward, rlhf, rlhf_loss
from .common import model_inputs, sum_over_group, trim_to_longest
from .sft_loss import StepBatches, masked_sum

__all__ = ["DEFAULT_TEMPLATE", "TEMPLATES", "ChatTemplate", "ExampleError", "assemble_row", "checked_messages",
           "encode_example", "encode_prompt", "pack_examples", "parse_example", "parse_preference", "truncate_example",
           "SFTDataError", "SFTDataset", "PreferenceDataset", "build_sft_datasets", "build_preference_datasets", "open_sft_files",
           "output_prefixes", "StepBatches", "masked_sum", "model_inputs", "sum_over_group", "trim_to_longest",
           "common", "dpo", "ema", "reward", "rlhf", "rlhf_loss"]
