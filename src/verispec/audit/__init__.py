"""`verispec audit`: paired quality per domain (shipped prompts, offline graders) between two configurations."""
