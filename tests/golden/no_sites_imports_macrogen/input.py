import macrogen as mg

# macrogen is imported but no macro is used: unchanged
print(mg.__version__)
