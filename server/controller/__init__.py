"""The controller: the control plane of a Pathways cluster (never carries array bytes)."""
