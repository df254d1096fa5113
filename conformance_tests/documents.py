"""The documents' input and every value they print, as NumPy data.

Each value cites its document, by the name ``torch_reference``'s table gives it, and cell; the
seed and call sequence that produce it are in the test that reproduces it
(``tests/test_documents.py``). The documents print 4 decimals, so a reproduction agrees within
half a unit in the last place (``PRINTED_ATOL``). Known errata (the chapter 3 article's 7x7
matrix, its "0.7074") are not here.
"""

import numpy as np

#: "Your journey starts with one step", 6 tokens of 3 features (every document but the
#: annotated-transformer post).
INPUTS = np.array(
    [
        [0.43, 0.15, 0.89],  # Your     (x^1)
        [0.55, 0.87, 0.66],  # journey  (x^2)
        [0.57, 0.85, 0.64],  # starts   (x^3)
        [0.22, 0.58, 0.33],  # with     (x^4)
        [0.77, 0.25, 0.10],  # one      (x^5)
        [0.05, 0.80, 0.55],  # step     (x^6)
    ],
    dtype=np.float32,
)

PRINTED_ATOL = 5e-5

# the chapter 3 notebook In[2], the self-attention notebook In[2]: scores of "journey"
# (inputs @ query)
ATTN_SCORES_JOURNEY = np.array([0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])
# the chapter 3 notebook In[3], the self-attention notebook: torch.softmax and softmax_naive of
# those scores
ATTN_WEIGHTS_JOURNEY = np.array([0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
# the self-attention notebook: naive normalisation attn_scores_2 / attn_scores_2.sum()
ATTN_WEIGHTS_JOURNEY_SUM_NORMALISED = np.array([0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656])
# the chapter 3 notebook In[4], the self-attention notebook: context vector of "journey"
CONTEXT_VEC_JOURNEY = np.array([0.4419, 0.6515, 0.5683])
# the self-attention notebook (and the chapter 3 article): the full score matrix inputs @ inputs.T
ATTN_SCORES = np.array(
    [
        [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
        [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
        [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
        [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
        [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
        [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450],
    ]
)
# the chapter 3 notebook In[5]: all six context vectors
CONTEXT_VECS = np.array(
    [
        [0.4421, 0.5931, 0.5790],
        [0.4419, 0.6515, 0.5683],
        [0.4431, 0.6496, 0.5671],
        [0.4304, 0.6298, 0.5510],
        [0.4671, 0.5910, 0.5266],
        [0.4177, 0.6503, 0.5645],
    ]
)

# seed 123, three torch.rand(3, 2) matrices W_query, W_key, W_value (the chapter 3 notebook and
# the self-attention notebook)
QUERY_JOURNEY_SEED123 = np.array([0.4306, 1.4551])  # the chapter 3 notebook In[7]
KEYS_SEED123 = np.array(  # the chapter 3 notebook In[8]
    [
        [0.3669, 0.7646],
        [0.4433, 1.1419],
        [0.4361, 1.1156],
        [0.2408, 0.6706],
        [0.1827, 0.3292],
        [0.3275, 0.9642],
    ]
)
VALUES_SEED123 = np.array(  # the chapter 3 notebook In[8]
    [
        [0.1855, 0.8812],
        [0.3951, 1.0037],
        [0.3879, 0.9831],
        [0.2393, 0.5493],
        [0.1492, 0.3346],
        [0.3221, 0.7863],
    ]
)
ATTN_SCORE_22_SEED123 = 1.8524  # the self-attention notebook: query_2.dot(keys_2)
ATTN_SCORES_JOURNEY_SEED123 = np.array(
    [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440]
)  # the chapter 3 notebook In[9]
ATTN_WEIGHTS_JOURNEY_SEED123 = np.array([0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820])  # In[10]
CONTEXT_VEC_JOURNEY_SEED123 = np.array([0.3061, 0.8210])  # the chapter 3 notebook In[11]

# the self-attention notebook In[4]: torch.manual_seed(123); SelfAttention_v1(3, 2)(inputs)
SELF_ATTENTION_V1_SEED123 = np.array(
    [
        [0.2996, 0.8053],
        [0.3061, 0.8210],
        [0.3058, 0.8203],
        [0.2948, 0.7939],
        [0.2927, 0.7891],
        [0.2990, 0.8040],
    ]
)
# the self-attention notebook In[5]: torch.manual_seed(789); SelfAttention_v2(3, 2)(inputs)
SELF_ATTENTION_V2_SEED789 = np.array(
    [
        [-0.0739, 0.0713],
        [-0.0748, 0.0703],
        [-0.0749, 0.0702],
        [-0.0760, 0.0685],
        [-0.0763, 0.0679],
        [-0.0754, 0.0693],
    ]
)
# the chapter 3 notebook In[13]: torch.manual_seed(123); SelfAttention(3, 2)(inputs)
SELF_ATTENTION_SEED123 = np.array(
    [
        [-0.5337, -0.1051],
        [-0.5323, -0.1080],
        [-0.5323, -0.1079],
        [-0.5297, -0.1076],
        [-0.5311, -0.1066],
        [-0.5299, -0.1081],
    ]
)
# the chapter 3 notebook In[14] and In[15]: the causal weights of that SelfAttention, both methods
CAUSAL_ATTN_WEIGHTS = np.array(
    [
        [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.4833, 0.5167, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.3190, 0.3408, 0.3402, 0.0000, 0.0000, 0.0000],
        [0.2445, 0.2545, 0.2542, 0.2468, 0.0000, 0.0000],
        [0.1994, 0.2060, 0.2058, 0.1935, 0.1953, 0.0000],
        [0.1624, 0.1709, 0.1706, 0.1654, 0.1625, 0.1682],
    ]
)
# the chapter 3 notebook In[16]: torch.manual_seed(123); torch.nn.Dropout(0.5)(CAUSAL_ATTN_WEIGHTS)
CAUSAL_ATTN_WEIGHTS_DROPOUT_SEED123 = np.array(
    [
        [2.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.6380, 0.6816, 0.6804, 0.0000, 0.0000, 0.0000],
        [0.0000, 0.5090, 0.5085, 0.0000, 0.0000, 0.0000],
        [0.0000, 0.4120, 0.0000, 0.3869, 0.0000, 0.0000],
        [0.0000, 0.3418, 0.3413, 0.3308, 0.3249, 0.0000],
    ]
)

# printed shapes
CAUSAL_BATCH_SHAPE = (
    2,
    6,
    2,
)  # the chapter 3 notebook In[19]: CausalAttention(3, 2, 6, 0.0)(batch)
WRAPPER_BATCH_SHAPE = (2, 6, 4)  # the chapter 3 notebook In[20]: wrapper, 2 heads of d_out 2
