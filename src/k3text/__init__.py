"""k3text: a config-driven JAX stack for Kimi K3 and Kimi Linear."""
