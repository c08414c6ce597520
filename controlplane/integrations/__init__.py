"""Drop-in integrations with the gateways people already run (issue 17)."""
