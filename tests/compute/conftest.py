import torch

# Tiny ops gain nothing from intra-op threads, the virtual ranks are threads already,
# and oversubscribed cores make everything crawl.
torch.set_num_threads(1)
