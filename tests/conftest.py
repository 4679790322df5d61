import torch

# one intra-op thread per process: forked ranks share 2 cores (docs/architecture.md, Facts)
torch.set_num_threads(1)
