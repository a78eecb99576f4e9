"""The silent-inconsistency experiment: DP fine-tuning under desynchronised settings, and its report."""
