# The README's two commands:
#   make pretrain   create .venv, install, build the embedded default data, train GPT-2 with ZeRO-2 (--deepspeed),
#                   then print a greedy and a top-p sampled continuation of a fixed prompt
#   make finetune   LoRA fine-tuning (ZeRO-2) of make pretrain's checkpoint on the embedded chat pairs (data/sft/):
#                   the validation perplexity and three held-out answers before and after
#   make rlhf       GRPO (train_rlhf.py) of make finetune's checkpoint with a verifiable reward (the answer's length):
#                   the mean reward of sampled validation answers before and after, plotted
#   make test       create .venv, install with test extras (building the default data meanwhile), run the test suite
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: pretrain finetune rlhf test install install-test data clean-data

$(VPY):
	$(PYTHON) -m venv $(VENV)

# --no-compile: pip skips byte-compiling every installed module (half the install's time: 2:32 -> 1:13 here);
# Python compiles the modules a run imports on first use and caches them, which an environment that sets
# PYTHONDONTWRITEBYTECODE would forbid: every process would compile torch again (import torch 3.7 s, not 1.9 s;
# torch._dynamo 9.4 s, not 3.5 s; the test suite starts hundreds of processes).
unexport PYTHONDONTWRITEBYTECODE
install: $(VPY)
	$(VPY) -m pip install -q --no-compile -r requirements.txt

install-test: $(VPY)   # DS_BUILD_OPS=0: DeepSpeed (a test oracle) installs without compiling its CUDA/C++ ops
	DS_BUILD_OPS=0 $(VPY) -m pip install -q --no-compile -r requirements-test.txt

data: install
	$(VPY) tools/prepare_default_data.py

pretrain: data
	PYTHON=$(VPY) bash scripts/ds_pretrain_gpt.sh
	PYTHON=$(VPY) bash scripts/generate_text.sh

finetune: data   # runs make pretrain first when its checkpoint is missing; builds data/sft/ on first use
	@test -f checkpoints/gpt2_zero2/latest_checkpointed_iteration.txt || $(MAKE) pretrain
	PYTHON=$(VPY) bash scripts/finetune_gpt.sh

rlhf: data   # runs make finetune (and make pretrain) first when their checkpoints are missing
	@test -f checkpoints/gpt2_lora/latest_checkpointed_iteration.txt || $(MAKE) finetune
	PYTHON=$(VPY) bash scripts/rlhf.sh

# The test extras install (pip: one core) while the default data (which the tests read) is built on the other:
# the data reads only the runtime packages, which the extras leave as they are. Then the suite, on 4 workers on 2
# cores: many tests wait (process start-up, timeouts of the hang tests, rendezvous), and the extra workers keep
# both cores busy meanwhile; --dist loadfile keeps each file's shared fixtures on one worker, and
# tests/conftest.py hands the longest files out first.
test: install
	DS_BUILD_OPS=0 $(VPY) -m pip install -q --no-compile -r requirements-test.txt & extras=$$!; \
	$(VPY) tools/prepare_default_data.py || { kill $$extras; exit 1; }; \
	wait $$extras
	$(VPY) -m pytest -q -n 4 --dist loadfile --durations=20 tests

clean-data:
	rm -rf data/webtext data/sft
