import torch

# one intra-op thread per process: forked ranks share 2 cores (DESIGN.md, Facts)
torch.set_num_threads(1)
