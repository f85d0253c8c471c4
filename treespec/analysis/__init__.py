"""Engine-side analysis: scoring treespec's own verifiers against ot_bounds (:mod:`.scoring`), and
measuring a draft head in the speculative engine (:mod:`.acceptance`: tau, step cost, the target's text)."""
