"""Hostile tests of the README's short float16 form,
`scaled_value_and_grad(filter_amp(loss_fn, policy="mixed_float16"))`, and
of `filter_amp`'s `arg_spec`, on small convolutional models that make arrays inside
the function: a GAN that samples its noise inside the loss and a diffusion model that
draws its noise and time there (and concatenates the time with the image before its
first convolution).

The matrix: convolutions and transposed convolutions meeting float32 arrays made
inside the loss (under strict promotion, and under JAX's default promotion as users
run it), with the time kept in float32 by `arg_spec`; values and gradients against
float32 references to float16's error bounds, and the convolutions' dtypes read from
the jaxpr; `arg_spec` in every accepted form and the ambiguous ones refused.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_amp

from .helpers import eqns_named, global_rel_error, in_dtypes


F16 = np.dtype("float16")


class Generator(eqx.Module):
    up: eqx.nn.ConvTranspose2d
    out: eqx.nn.Conv2d

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.up = eqx.nn.ConvTranspose2d(2, 4, 2, stride=2, key=k1)
        self.out = eqx.nn.Conv2d(4, 1, 3, padding=1, key=k2)

    def __call__(self, z):  # z: (2, 4, 4) noise
        return jnp.tanh(self.out(jax.nn.relu(self.up(z))))  # (1, 8, 8)


class Discriminator(eqx.Module):
    conv: eqx.nn.Conv2d

    def __init__(self, key):
        self.conv = eqx.nn.Conv2d(1, 2, 3, stride=2, key=key)

    def __call__(self, image):
        return jnp.mean(jax.nn.relu(self.conv(image)))


class Denoiser(eqx.Module):
    """Concatenates the time, as a channel, with the image before its first conv."""

    first: eqx.nn.Conv2d
    second: eqx.nn.Conv2d

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.first = eqx.nn.Conv2d(2, 4, 3, padding=1, key=k1)
        self.second = eqx.nn.Conv2d(4, 1, 3, padding=1, key=k2)

    def __call__(self, t, x):  # t: scalar, x: (1, 8, 8)
        h = jnp.concatenate([x, jnp.broadcast_to(t, x.shape)])
        return self.second(jax.nn.relu(self.first(h)))


def generator_loss(models, key):
    """The GAN's generator loss: its noise is sampled here, in float32."""
    generator, discriminator = models
    z = jr.normal(key, (4, 2, 4, 4))
    fake = jax.vmap(generator)(z)
    return jnp.mean(jax.nn.softplus(-jax.vmap(discriminator)(fake)))


def diffusion_loss(model, images, key):
    """Noise and time are drawn here, in float32, and meet the (float16) images."""
    k1, k2 = jr.split(key)
    t = jr.uniform(k1, (images.shape[0],))
    noise = jr.normal(k2, images.shape)
    scale = t[:, None, None, None]
    noisy = jnp.sqrt(1 - scale) * images + jnp.sqrt(scale) * noise
    predicted = jax.vmap(model)(t, noisy)
    return jnp.mean((predicted.astype(jnp.float32) - noise) ** 2)


def _short_form_step(loss_fn):
    """The README's three-line float16 form."""
    optim = eqx_amp.loss_scaling(optax.sgd(1e-2))

    @eqx.filter_jit
    def step(params, opt_state, *args):
        (loss, grads), _ = eqx_amp.scaled_value_and_grad(
            eqx_amp.filter_amp(loss_fn, policy="mixed_float16")
        )(params, *args, opt_state=opt_state)
        return loss, grads

    return optim, step


def _conv_dtypes(fn, *args):
    jaxpr = eqx.filter_make_jaxpr(fn)(*args)[0]
    return [in_dtypes(e) for e, _ in eqns_named(jaxpr, "conv_general_dilated")]


_GAN = (Generator(jr.key(0)), Discriminator(jr.key(1)))
_DENOISER = Denoiser(jr.key(2))
_IMAGES = jr.normal(jr.key(3), (4, 1, 8, 8))


def test_gan_with_noise_sampled_inside_the_loss_trains_in_float16():
    """The noise meets float16 convolution weights: JAX raised "requires arguments to
    have the same dtypes". Strict promotion: nothing is promoted silently."""
    optim, step = _short_form_step(generator_loss)
    opt_state = optim.init(eqx.filter(_GAN, eqx.is_array))
    loss, grads = step(_GAN, opt_state, jr.key(4))
    reference_loss, reference = eqx.filter_value_and_grad(generator_loss)(
        _GAN, jr.key(4)
    )
    assert abs(float(loss) - float(reference_loss)) < 1e-2 * abs(float(reference_loss))
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype("float32")}
    assert global_rel_error(grads, reference) < 2e-2
    amp_loss = eqx_amp.filter_amp(generator_loss, policy="mixed_float16")
    convs = _conv_dtypes(amp_loss, _GAN, jr.key(4))
    assert len(convs) == 3 and all(d == [F16, F16] for d in convs)


@pytest.mark.slow  # the GAN above keeps noise drawn inside the loss in the fast tier
def test_diffusion_with_noise_drawn_inside_the_loss_trains_in_float16():
    """As users run it (JAX's default promotion): the float32 noise widens the
    float16 images, and the first convolution met them with float16 weights."""
    optim, step = _short_form_step(diffusion_loss)
    opt_state = optim.init(eqx.filter(_DENOISER, eqx.is_array))
    with jax.numpy_dtype_promotion("standard"):
        loss, grads = step(_DENOISER, opt_state, _IMAGES, jr.key(5))
        reference_loss, reference = eqx.filter_value_and_grad(diffusion_loss)(
            _DENOISER, _IMAGES, jr.key(5)
        )
        amp_loss = eqx_amp.filter_amp(diffusion_loss, policy="mixed_float16")
        convs = _conv_dtypes(amp_loss, _DENOISER, _IMAGES, jr.key(5))
    assert abs(float(loss) - float(reference_loss)) < 1e-2 * abs(float(reference_loss))
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype("float32")}
    assert global_rel_error(grads, reference) < 2e-2
    assert len(convs) == 2 and all(d == [F16, F16] for d in convs)


def test_a_time_kept_by_arg_spec_can_be_concatenated_with_the_image():
    """`arg_spec` keeps the time in float32; the model concatenates it with the
    (float16) image before its first convolution, which raised JAX's dtype error.
    The time arrives exactly, and the convolutions run in float16."""
    ts = jnp.array([0.1, 0.37, 0.999])
    images = _IMAGES[:3]
    keep_time = eqx_amp.filter_amp(
        _DENOISER, policy="mixed_float16", arg_spec=((False, True), {})
    )
    with jax.numpy_dtype_promotion("standard"):  # as users run it
        out = jax.vmap(keep_time)(ts, images)
        convs = _conv_dtypes(eqx.filter_vmap(keep_time), ts, images)
    reference = jax.vmap(_DENOISER)(ts, images)
    assert out.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(out - reference))) < 1e-2 * float(
        jnp.max(jnp.abs(reference))
    )
    assert len(convs) == 2 and all(d == [F16, F16] for d in convs)


class ScoreMixer(eqx.Module):
    """Equinox's score-based diffusion example, small: the time is concatenated
    with the image as a channel, a convolution makes patches, an MLP mixes them."""

    conv_in: eqx.nn.Conv2d
    mlp: eqx.nn.MLP
    conv_out: eqx.nn.ConvTranspose2d

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.conv_in = eqx.nn.Conv2d(2, 4, 2, stride=2, key=k1)
        self.mlp = eqx.nn.MLP(16, 16, 32, 1, key=k2)
        self.conv_out = eqx.nn.ConvTranspose2d(4, 1, 2, stride=2, key=k3)

    def __call__(self, t, y):  # t: scalar, y: (1, 8, 8)
        y = jnp.concatenate([y, jnp.broadcast_to(t, y.shape)])
        patches = self.conv_in(y)  # (4, 4, 4)
        mixed = jax.vmap(self.mlp)(patches.reshape(4, 16))
        return self.conv_out(mixed.reshape(4, 4, 4))


def _matmul_dtypes(fn, *args):
    jaxpr = eqx.filter_make_jaxpr(fn)(*args)[0]
    names = ("dot_general", "conv_general_dilated")
    return [(e.primitive.name, in_dtypes(e)) for e, _ in eqns_named(jaxpr, *names)]


@pytest.mark.parametrize("form", ["short", "arg_spec"])
def test_a_float32_time_through_a_convolution_leaves_the_mlp_after_it_narrow(form):
    """The convolution's output is in its weight's dtype: cast back to the float32
    of the time concatenated with the image, it made the MLP after it run in
    float32 (27% of the FLOPs in float16), and the report blamed `eqx.nn.MLP`."""
    model = ScoreMixer(jr.key(8))
    if form == "short":
        amp = eqx_amp.filter_amp(diffusion_loss, policy="mixed_float16")
        args = (model, _IMAGES, jr.key(9))
    else:
        amp = eqx_amp.filter_amp(
            model, policy="mixed_float16", arg_spec=((False, True), {})
        )
        args = (jnp.float32(0.3), _IMAGES[0])
    with jax.numpy_dtype_promotion("standard"):  # as users run it
        matmuls = _matmul_dtypes(amp, *args)
        report = eqx_amp.precision_report(amp, *args)
    assert [name for name, _ in matmuls].count("dot_general") == 2
    assert len(matmuls) == 4 and all(d == [F16, F16] for _, d in matmuls), matmuls
    assert report.low_precision_share == 1.0 and report.advice == ""


def test_a_convolution_given_data_narrower_than_its_kept_weight_hands_it_back():
    """A filter spec that keeps a convolution's weight but not its bias: the
    convolution runs at the weight's float32, and hands back the caller's float16,
    as a kept layer does."""
    net = eqx.nn.Sequential(
        [eqx.nn.Conv2d(1, 2, 3, key=jr.key(10)), eqx.nn.Conv2d(2, 1, 3, key=jr.key(11))]
    )
    spec = jax.tree.map(lambda _: True, net)
    spec = eqx.tree_at(lambda s: s.layers[0].weight, spec, False)
    amp = eqx_amp.filter_amp(net, policy="mixed_float16", filter_spec=spec)
    with jax.numpy_dtype_promotion("standard"):
        convs = _conv_dtypes(amp, _IMAGES[0])
    assert convs == [[np.dtype("float32")] * 2, [F16, F16]]


def test_a_convolution_kept_in_full_precision_reads_its_inputs_in_float32():
    """The cast follows the weight's dtype at the call: `full_precision` around a
    convolution inside the model makes it float32, and its input follows."""

    class Net(eqx.Module):
        conv: eqx.nn.Conv2d
        head: eqx.nn.Conv2d

        def __call__(self, x):
            return eqx_amp.full_precision(self.head)(self.conv(x))

    net = Net(
        eqx.nn.Conv2d(1, 2, 3, key=jr.key(6)), eqx.nn.Conv2d(2, 1, 3, key=jr.key(7))
    )
    amp = eqx_amp.filter_amp(net, policy="mixed_float16")
    convs = _conv_dtypes(amp, _IMAGES[0])
    assert convs == [[F16, F16], [np.dtype("float32")] * 2]


@pytest.mark.parametrize("spec", [(False, True), [False, True], (True, False)])
def test_an_ambiguous_arg_spec_is_refused(spec):
    """`(False, True)` reads as two positional flags, or as a prefix of `(args,
    kwargs)` (positional arguments kept, keyword arguments cast), which is how it
    was silently taken."""
    with pytest.raises(ValueError, match=r"`arg_spec=.*` is ambiguous"):
        eqx_amp.filter_amp(_DENOISER, arg_spec=spec)


@pytest.mark.parametrize(
    "spec",
    [True, False, ((False, True), {}), ((False, True), True), lambda leaf: True],
)
def test_unambiguous_arg_specs_are_accepted(spec):
    amp = eqx_amp.filter_amp(_DENOISER, policy="mixed_float16", arg_spec=spec)
    with jax.numpy_dtype_promotion("standard"):
        out = amp(jnp.asarray(0.5), _IMAGES[0])
    assert out.shape == (1, 8, 8) and bool(jnp.all(jnp.isfinite(out)))
