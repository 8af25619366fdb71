"""Studies: scripts that measure a question and write what they found."""
