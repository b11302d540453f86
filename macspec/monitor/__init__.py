"""Memory accounting and admission, and the `macspec doctor` checks."""
