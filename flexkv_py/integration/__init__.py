"""Engine integrations: adapters that plug the FlexKV tiers into inference engines."""
