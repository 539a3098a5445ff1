"""Where the weights go: bytes per parameter kind (`accounting`), the memory plan for a GPU size
(`planning`, behind `drama3 plan`) and the device map that splits the backbone over several devices
(`device_map`). Above the model, which it measures; below the commands and serving."""
