"""Engine-side analysis: scoring treespec's own verifiers against ot_bounds."""
