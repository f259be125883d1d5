"""scikit-learn's bundled digits: 1,797 real 8x8 grey-scale images of hand-written digits, values 0..16."""

from dpmem.data.images import image_bundle


def load(cfg):
    # imported here: build_data imports every loader, and sklearn takes a second to import
    from sklearn.datasets import load_digits
    digits = load_digits()
    return image_bundle(digits.images, digits.target, test_fraction=cfg.test_fraction,
                        split_seed=cfg.split_seed, scale=16.0)
