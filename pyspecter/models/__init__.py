"""Models the project makes itself: tiny random-weight MoE fixtures, smol-moe, drafts."""
