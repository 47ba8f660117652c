"""The GPU runtime's row scatter (numpy reference; kernel: ../scatter_rows.cu)."""
