"""Post-training objectives (SFT, DPO, KTO, reward models): losses, configuration and the step objects."""
